"""The weights inside a checkpoint: which folder a path names (a run, its ``checkpoints``, a fine-tuning run's
best), the full fp32 state dict of any ZeRO stage, and the model its ``meta.json`` describes. Read by
``distaff export-hf``, model folders (``model.init_from``) and the fine-tuning trainer."""

from __future__ import annotations

from pathlib import Path

import torch

from distaff.train.core.safe_load import safe_load, weights_only_loads
from distaff.train.core.verbosity import library_chatter_hidden
from distaff.train.model.classifier import DebertaForSequenceClassification
from distaff.train.model.config import ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.model.rtd import ReplacedTokenDetection
from distaff.train.run.checkpoint import META, is_complete, latest_checkpoint

MODEL_STATES = "mp_rank_00_model_states.pt"
CLASSIFIER_TASK = "sequence_classification"   # meta.json "task" of a fine-tuning checkpoint


BEST_DIR = "best"   # where a fine-tuning run keeps its best checkpoint (train/finetune/trainer.py)


def find_checkpoint(path: str | Path, latest: bool = False) -> Path:
    """The checkpoint folder ``path`` names: itself, or the latest complete one under it; in a
    fine-tuning run directory the best checkpoint, unless ``latest``."""
    path = Path(path)
    if is_complete(path):
        return path
    roots = [path, path / "checkpoints"]
    if not latest:
        roots.insert(0, path / BEST_DIR)
    for root in roots:
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    raise FileNotFoundError(f"{path}: no complete checkpoint here (a folder with {META}, or a run/checkpoints "
                            "folder holding one)")


def fp32_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights from a checkpoint of any ZeRO stage (stage 0 fp32/fp16: the module state)."""
    if any(checkpoint.glob("*optim_states.pt")):
        # ZeRO 1-3 and bf16 keep the fp32 master weights partitioned in the optimizer files
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        # zero_to_fp32 itself would unpickle with weights_only=False; it prints and draws a bar for every load
        with weights_only_loads(), library_chatter_hidden():
            return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    states = safe_load(checkpoint / MODEL_STATES)
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
