"""The weights inside a checkpoint: which folder a path names (a run, its ``checkpoints``, a fine-tuning run's
best) verified against its ``files.json`` as resume verifies it, the full fp32 state dict of any ZeRO stage, and
the model its ``meta.json`` describes. Every command that reads a checkpoint's weights comes here: ``distaff
export-hf``, model folders (``grow``, ``embed``, ``probe``, fine-tuning's ``model.init_from``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

from distaff.train.core.errors import UserError
from distaff.train.core.safe_load import safe_load, weights_only_loads
from distaff.train.core.verbosity import library_chatter_hidden
from distaff.train.data.errors import DataError
from distaff.train.model.classifier import DebertaForSequenceClassification
from distaff.train.model.config import ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.model.rtd import ReplacedTokenDetection
from distaff.train.run.checkpoint import META, is_complete, newest_sound_checkpoint
from distaff.train.run.checkpoint_files import checkpoint_problem

MODEL_STATES = "mp_rank_00_model_states.pt"
CLASSIFIER_TASK = "sequence_classification"   # meta.json "task" of a fine-tuning checkpoint


BEST_DIR = "best"   # where a fine-tuning run keeps its best checkpoint (train/finetune/trainer.py)


def find_checkpoint(path: str | Path, latest: bool = False,
                    report: Callable[[str], None] = lambda message: print(message, file=sys.stderr)) -> Path:
    """The checkpoint folder ``path`` names, verified against its ``files.json`` as resume verifies it.

    A checkpoint folder named explicitly must be sound (else a :class:`DataError` naming the damaged file); a run
    directory or ``checkpoints`` folder gives its newest sound checkpoint, each newer damaged one passed over with
    a line to ``report``; in a fine-tuning run directory the best checkpoint comes first, unless ``latest``."""
    path = Path(path)
    if is_complete(path):
        problem = checkpoint_problem(path)
        if problem:
            raise DataError(f"{path}: damaged checkpoint: {problem}; name an older checkpoint, or the run directory "
                            "(its newest sound checkpoint is then used)")
        return path
    roots = [path, path / "checkpoints"]
    if not latest:
        roots.insert(0, path / BEST_DIR)
    damaged: list[str] = []
    for root in roots:
        found = newest_sound_checkpoint(root, lambda line: (damaged.append(line), report(line)))
        if found is not None:
            return found
    if damaged:
        raise DataError(f"{path}: every checkpoint here is damaged ({damaged[-1].split(': ', 1)[-1]}); "
                        "there is nothing sound to read")
    raise FileNotFoundError(f"{path}: no complete checkpoint here (a folder with {META}, or a run/checkpoints "
                            "folder holding one)")


def fp32_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights from a checkpoint of any ZeRO stage (stage 0 fp32/fp16: the module state); pass a folder
    :func:`find_checkpoint` returned (verified). A file that still cannot be read (a checkpoint written before
    file lists existed) is a :class:`DataError` naming it."""
    try:
        if any(checkpoint.glob("*optim_states.pt")):
            # ZeRO 1-3 and bf16 keep the fp32 master weights partitioned in the optimizer files
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            # zero_to_fp32 itself would unpickle with weights_only=False; it prints and draws a bar for every load
            with weights_only_loads(), library_chatter_hidden():
                return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
        states = safe_load(checkpoint / MODEL_STATES)
    except (RuntimeError, EOFError, KeyError, ValueError, AssertionError) as err:
        if isinstance(err, UserError):
            raise
        raise DataError(f"{checkpoint}: its weights cannot be read ({type(err).__name__}: {err}); name another "
                        "checkpoint") from None
    return {k: v.float() for k, v in states["module"].items()}


def model_from_meta(meta: dict, source: str):
    """The model a checkpoint's ``meta.json`` describes: ``DebertaForMaskedLM``, for an RTD run
    ``ReplacedTokenDetection`` (generator and discriminator, embeddings shared as in training), for a
    fine-tuning run ``DebertaForSequenceClassification``."""
    model_cfg = ModelConfig.from_dict(meta["model_config"], f"{source} model_config")
    if meta.get("task") == CLASSIFIER_TASK:
        return DebertaForSequenceClassification(model_cfg, meta["num_labels"], meta["pooler_dropout"])
    if meta["config"]["train"].get("objective", "mlm") != "rtd":
        return DebertaForMaskedLM(model_cfg)
    generator_cfg = ModelConfig.from_dict(meta["generator_config"], f"{source} generator_config")
    rtd = meta["config"]["rtd"]
    return ReplacedTokenDetection(generator_cfg, model_cfg, sharing=rtd["embedding_sharing"], weight=rtd["weight"],
                                  loss_weighting=rtd.get("loss_weighting", "fixed"))
