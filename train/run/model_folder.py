"""Trained weights from wherever they are: a distaff model folder, a checkpoint, or an HF folder.

A *distaff model folder* holds every weight of a :class:`DebertaForMaskedLM` under distaff's
names (the Enhanced Mask Decoder included, and models Hugging Face cannot run, such as RoPE) in
``model.safetensors``, the full :class:`ModelConfig` in ``distaff_model.json`` and the tokenizer
in ``tokenizer/``. ``distaff grow`` writes one; ``model.init_from`` starts a run from one (or
from an HF folder); ``distaff embed`` reads any of the three. Nothing is unpickled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from distaff.train.core.errors import shown
from distaff.train.core.files import chmod_default, read_json
from distaff.train.data.tokenizer import METADATA_FILE, MODEL_FILE
from distaff.train.model.config import ConfigError, ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM

MODEL_CONFIG_FILE = "distaff_model.json"
WEIGHTS_FILE = "model.safetensors"


def save_model_folder(model: DebertaForMaskedLM, out: str | Path, tokenizer: str | Path | None) -> Path:
    """Write ``model`` (and a copy of the ``tokenizer`` folder) as a distaff model folder."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: t.detach().cpu().contiguous() for k, t in model.state_dict().items()}
    save_file(state, out / WEIGHTS_FILE, metadata={"format": "pt", "distaff": "DebertaForMaskedLM"})
    chmod_default(out / WEIGHTS_FILE)  # safetensors writes it 0600
    (out / MODEL_CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=1) + "\n")
    if tokenizer is not None:
        shutil.copytree(tokenizer, out / "tokenizer", dirs_exist_ok=True)
    return out


def read_model_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / MODEL_CONFIG_FILE
    return ModelConfig.from_dict(read_json(path, error=ConfigError), str(path))


def _tokenizer_beside(folder: Path) -> Path | None:
    for candidate in (folder / "tokenizer", folder):
        # ours (with its metadata), or a Hugging Face folder's own spm.model (tokenizer.hf_tokenizer_info)
        if (candidate / METADATA_FILE).is_file() or (candidate / MODEL_FILE).is_file():
            return candidate
    return None


def load_model(path: str | Path, **overrides) -> tuple[DebertaForMaskedLM, Path | None]:
    """The model at ``path`` (distaff model folder, checkpoint or run directory, or HF folder) and
    its tokenizer folder (None if it has none); ``overrides`` change non-weight fields (dropout, impl)."""
    folder = Path(path)
    if (folder / MODEL_CONFIG_FILE).is_file():
        model = DebertaForMaskedLM(read_model_config(folder).replace(**overrides))
        model.load_state_dict(load_file(folder / WEIGHTS_FILE), strict=True)
        return model, _tokenizer_beside(folder)
    if (folder / "config.json").is_file():
        from distaff.train.model.hf import from_hf

        return from_hf(folder, **overrides), _tokenizer_beside(folder)
    from distaff.train.run.checkpoint import META
    from distaff.train.run.weights import find_checkpoint, fp32_state_dict

    try:
        checkpoint = find_checkpoint(folder)
    except FileNotFoundError:
        raise FileNotFoundError(f"{folder}: not a model: expected a distaff model folder ({MODEL_CONFIG_FILE}), "
                                "a Hugging Face folder (config.json) or a checkpoint / run directory") from None
    meta = json.loads((checkpoint / META).read_text())
    _check_one_model(checkpoint, meta)
    cfg = ModelConfig.from_dict(meta["model_config"], f"{checkpoint / META} model_config").replace(**overrides)
    model = DebertaForMaskedLM(cfg)
    model.load_state_dict(fp32_state_dict(checkpoint), strict=True)
    return model, _tokenizer_beside(checkpoint)


def _check_one_model(checkpoint: Path, meta: dict) -> None:
    """A checkpoint of an RTD run (two networks) or of a fine-tuning run (a classifier) is not one masked-LM
    model: say which folder to export instead of failing on its weights' names."""
    from distaff.train.run.weights import CLASSIFIER_TASK

    if meta.get("config", {}).get("train", {}).get("objective") == "rtd":
        raise ConfigError(f"{checkpoint}: a checkpoint of an RTD run holds a generator and a discriminator, not one "
                          f"model; export the one you want and use that folder: `distaff export-hf {checkpoint} OUT` "
                          "writes the discriminator (an encoder: fine-tuning, embed), with --generator the generator "
                          "(a masked-LM model: grow, model.init_from)")
    if meta.get("task") == CLASSIFIER_TASK:
        raise ConfigError(f"{checkpoint}: a checkpoint of a fine-tuning run (a classifier), not a pretrained "
                          f"model; export it (`distaff export-hf {checkpoint} OUT`) and use that folder")


# Fields a run may change when it starts from existing weights: they change neither the weights'
# shapes nor what the weights compute (the EMD, absent from HF folders, starts freshly initialised).
FREE_FIELDS = ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_impl", "kernel_impl",
               "activation_checkpointing", "keep_position_scores", "initializer_range", "emd", "emd_layers")


def init_model_config(path: str | Path, overrides: dict, fixed: dict) -> ModelConfig:
    """``model.init_from``'s architecture with the run's ``overrides`` (free fields only, or the same
    value) and ``fixed`` values the data imposes (vocabulary size, padding id), which must agree."""
    folder = Path(path)
    if (folder / MODEL_CONFIG_FILE).is_file():
        base = read_model_config(folder)
    elif (folder / "config.json").is_file():
        from distaff.train.model.hf import model_config_from_hf

        base = model_config_from_hf(read_json(folder / "config.json", error=ConfigError), str(folder / "config.json"),
                                    emd=True)
    else:
        raise ConfigError(f"model.init_from: {folder} is not a model folder (no {MODEL_CONFIG_FILE} or config.json); "
                          "for a run directory or checkpoint, make one first: `distaff grow RUN OUT` (same size with "
                          "no size options) or `distaff export-hf RUN OUT`")
    values = base.to_dict()
    for name, value in {**overrides, **fixed}.items():
        if name not in FREE_FIELDS and values.get(name) != value:
            source = "the data's tokenizer" if name in fixed else f"model.{name}"
            raise ConfigError(f"model.init_from: {folder} has {name}={values.get(name)!r} but {source} asks for "
                              f"{shown(value)}; a run that starts from existing weights keeps their architecture")
        values[name] = value
    return ModelConfig.from_dict(values, f"model.init_from {folder}")


def load_initial_weights(model: DebertaForMaskedLM, path: str | Path) -> None:
    """``model.init_from``'s weights into ``model`` (built by :func:`init_model_config`)."""
    folder = Path(path)
    if (folder / MODEL_CONFIG_FILE).is_file():
        state = load_file(folder / WEIGHTS_FILE)
        expected = model.state_dict()
        # the EMD may have been switched on or off for this run: only its weights may be missing or extra
        state = {k: v for k, v in state.items() if k in expected or not k.startswith("emd.")}
        missing = [k for k in expected if k not in state and not k.startswith("emd.")]
        if missing:
            raise ValueError(f"{folder / WEIGHTS_FILE}: missing weights {missing[:10]}")
        model.load_state_dict(state, strict=False)
        return
    from distaff.train.model.hf import _distaff_state, read_hf_weights

    model.load_state_dict(_distaff_state(read_hf_weights(folder), model, str(folder)), strict=False)
