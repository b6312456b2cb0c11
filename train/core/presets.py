"""The presets installed with distaff (the ``distaff.configs`` package: ``configs/<kind>/<name>.yaml``).

Kinds: ``model`` (one ModelConfig each), ``run`` (pretraining), ``finetune`` and ``ablation``. A preset is
addressed by name from any folder (``--config tiny-cpu``); a file path is used as given.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SUFFIX = ".yaml"


def _folder(kind: str):
    return resources.files("distaff.configs") / kind


def preset_names(kind: str) -> list[str]:
    """The names of the installed presets of ``kind``, sorted."""
    return sorted(p.name[: -len(SUFFIX)] for p in _folder(kind).iterdir() if p.name.endswith(SUFFIX))


def preset_file(name: str, kind: str) -> Path | None:
    """The file of the preset ``name`` (``tiny-cpu`` or ``tiny-cpu.yaml``) of ``kind``, if there is one."""
    if not name or "/" in name or "\\" in name:
        return None
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
    resource = _folder(kind) / f"{stem}{SUFFIX}"
    return Path(str(resource)) if resource.is_file() else None
