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


KINDS = {"run": "pretraining runs (distaff pretrain / launch / slurm --config NAME)",
         "model": "model shapes (model.preset=NAME in a run config)",
         "finetune": "fine-tuning runs (distaff finetune --config NAME)",
         "ablation": "ablation studies (distaff ablate --config NAME)"}
CONFIG_HELP = "a YAML file, or the name of an installed preset (`distaff presets` lists them)"


def description(kind: str, name: str) -> str:
    """The first comment line of a preset's YAML, which says what it is for."""
    for line in (_folder(kind) / f"{name}{SUFFIX}").read_text().splitlines():
        if line.startswith("#"):
            text = line.lstrip("#").strip().rstrip(":")
            return text[len(name) + 1:].strip() if text.startswith(f"{name}:") else text
    return ""


def listing(kinds: list[str] | None = None) -> str:
    """Every installed preset of ``kinds`` (all when None), grouped by kind, one line each."""
    lines: list[str] = []
    for kind in kinds or list(KINDS):
        names = preset_names(kind)
        width = max(map(len, names), default=0)
        lines += ["" if lines else None, f"{kind}: {KINDS[kind]}"]
        lines += [f"  {name:<{width}}  {description(kind, name)}" for name in names]
    return "\n".join(line for line in lines if line is not None)


def main(argv: list[str] | None = None) -> int:
    """``distaff presets [KIND ...]``: the installed presets, one line each."""
    import argparse
    import sys

    from distaff.train.core.errors import UserError, closest, command_main

    def body(args: list[str]) -> int:
        parser = argparse.ArgumentParser(prog="distaff presets", description="the presets installed with distaff")
        parser.add_argument("kinds", nargs="*", metavar="KIND", help=f"only these kinds: {', '.join(KINDS)}")
        kinds = parser.parse_args(args).kinds
        for kind in kinds:
            if kind not in KINDS:
                guess = closest(kind, KINDS)
                raise UserError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}"
                                + (f"; did you mean {guess}?" if guess else ""))
        print(listing(kinds))
        return 0

    return command_main("distaff presets", body, sys.argv[1:] if argv is None else argv)
