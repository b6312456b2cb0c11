"""``distaff export-hf CHECKPOINT OUT``: a training checkpoint (any ZeRO stage) to a Hugging Face folder.

CHECKPOINT is a checkpoint folder (``.../checkpoints/step-00001000``), a ``checkpoints`` folder or a
run directory (the latest complete checkpoint is used; for a fine-tuning run the best one, under
``best/``, unless ``--latest``). The folder written loads with
``AutoModelForMaskedLM`` and ``AutoTokenizer``; the Enhanced Mask Decoder is not exported. From an
RTD run (``train.objective=rtd``) the discriminator is written, as a ``DebertaV2Model`` folder
(``AutoModel``) with its RTD head kept as ``mask_predictions.*``; ``--generator`` writes the
generator as a ``DebertaV2ForMaskedLM`` folder instead. A fine-tuning run's checkpoint is written as a
``DebertaV2ForSequenceClassification`` folder (``AutoModelForSequenceClassification``, the
``text-classification`` pipeline) with its labels as ``id2label``/``label2id`` and its ``problem_type``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from distaff.train.core.distributed import quiet_library_warnings
from distaff.train.core.errors import ConfigError, command_main
from distaff.train.core.files import check_apart, check_out_dir, replaced_folder
from distaff.train.core.threads import configure_threads
from distaff.train.run.checkpoint import META
from distaff.train.run.checkpoint_files import check_apart_from_checkpoints
from distaff.train.run.weights import CLASSIFIER_TASK, find_checkpoint, fp32_state_dict, model_from_meta


def export(checkpoint: str | Path, out: str | Path, tokenizer: str | Path | None = None,
           overwrite: bool = False, generator: bool = False, latest: bool = False) -> Path:
    """Write the HF folder for ``checkpoint`` into ``out`` (an RTD run's discriminator, or with
    ``generator`` its generator; a fine-tuning run's best checkpoint, or with ``latest`` its latest);
    returns ``out``."""
    check_apart_from_checkpoints(("output folder", out), [("checkpoint", checkpoint)])
    check_apart(("output folder", out), [("--tokenizer", tokenizer)])
    check_out_dir(Path(out), overwrite)
    folder = find_checkpoint(checkpoint, latest)
    with replaced_folder(out) as fresh:     # --overwrite: no file of the old folder survives
        _write(folder, fresh, tokenizer, generator)
    return Path(out)


def _write(folder: Path, out: Path, tokenizer: str | Path | None, generator: bool) -> Path:
    from distaff.train.model.hf import classifier_to_hf, discriminator_to_hf, to_hf

    meta = json.loads((folder / META).read_text())
    tokenizer = tokenizer or (folder / "tokenizer" if (folder / "tokenizer").is_dir() else None)
    if tokenizer is None:
        raise FileNotFoundError(f"{folder}: no tokenizer copy in the checkpoint; pass --tokenizer DIR")
    model = model_from_meta(meta, f"{folder / META}")
    model.load_state_dict(fp32_state_dict(folder), strict=True)
    if meta.get("task") == CLASSIFIER_TASK:
        if generator:
            raise ConfigError(f"{folder}: --generator needs a checkpoint of an RTD run, not a fine-tuning run")
        return classifier_to_hf(model, out, tokenizer, meta["label_names"])
    if not hasattr(model, "discriminator"):
        if generator:
            raise ConfigError(f"{folder}: --generator needs a checkpoint of an RTD run (train.objective=rtd)")
        return to_hf(model, out, tokenizer=tokenizer)
    if generator:
        return to_hf(model.generator, out, tokenizer=tokenizer)
    return discriminator_to_hf(model.discriminator, out, tokenizer, model.discriminator_word_embeddings())


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff export-hf", _main, argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="distaff export-hf", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="checkpoint folder, checkpoints folder or run directory")
    parser.add_argument("out", help="output folder for the Hugging Face model")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the checkpoint's copy)")
    parser.add_argument("--overwrite", action="store_true", help="write into OUT even if it already holds files")
    parser.add_argument("--generator", action="store_true",
                        help="RTD runs: write the generator (DebertaV2ForMaskedLM) instead of the discriminator")
    parser.add_argument("--latest", action="store_true",
                        help="fine-tuning runs: the latest checkpoint instead of the best one (best/)")
    args = parser.parse_args(argv)
    configure_threads(announce=False)
    quiet_library_warnings(rank=0)      # DeepSpeed's zero_to_fp32 is imported on CPU machines too
    out = export(args.checkpoint, args.out, args.tokenizer, args.overwrite, args.generator, args.latest)
    architecture = json.loads((out / "config.json").read_text())["architectures"][0]
    loader = {"DebertaV2Model": "AutoModel", "DebertaV2ForSequenceClassification":
              "AutoModelForSequenceClassification"}.get(architecture, "AutoModelForMaskedLM")
    print(f"distaff export-hf: wrote {out} ({architecture}: load with {loader} / AutoTokenizer)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
