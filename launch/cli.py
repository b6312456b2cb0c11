"""The ``distaff`` command: one entry point, each subcommand owned by the module that implements it."""

from __future__ import annotations

import importlib
import sys

from distaff.train.core.errors import take_debug_flag
from distaff.train.core.verbosity import take_verbose_flag

# subcommand -> (module with a ``main(argv)``, one-line help)
COMMANDS = {
    "tokenizer": ("distaff.train.data.tokenizer", "train a SentencePiece tokenizer (distaff tokenizer train ...)"),
    "data": ("distaff.train.data.cli", "prepare and verify webdataset shards (distaff data prepare|verify ...)"),
    "pretrain": ("distaff.train.pretrain.trainer", "pretrain a DeBERTa model (--config CONFIG.yaml [key=value ...])"),
    "finetune": ("distaff.train.finetune.trainer", "fine-tune a classifier/regressor (--config FT.yaml [key=value ...])"),
    "export-hf": ("distaff.train.tools.export", "export a checkpoint to a Hugging Face folder"),
    "ablate": ("distaff.train.tools.ablate", "run config variants on equal budgets and seeds, compare them"),
    "average": ("distaff.train.tools.average", "average checkpoints' weights (uniform or --ema) into a checkpoint"),
    "grow": ("distaff.train.tools.grow", "widen/deepen a trained model, outputs unchanged (distaff grow CKPT OUT ...)"),
    "embed": ("distaff.train.tools.embed", "sentence embeddings of a text file, optional whitening (distaff embed ...)"),
    "probe": ("distaff.train.tools.probe", "probing tasks (word order, length, words) for frozen and fine-tuned encoders"),
    "evals": ("distaff.train.tools.evals.cli", "run a run's missing checkpoint evaluations (evals), table and plot"),
    "plan": ("distaff.train.plan.cli", "memory per GPU, micro-batch, ZeRO stage, tokens/s, MFU, GPU-hours before booking"),
    "presets": ("distaff.train.core.presets", "list the installed run, model, fine-tune and ablation presets"),
    "launch": ("distaff.launch.launcher", "run pretraining (or --task finetune) under the deepspeed launcher"),
    "slurm": ("distaff.launch.slurm", "write and submit a Slurm job for pretraining (or --task finetune)"),
    "decay": ("distaff.launch.decay", "a decay branch of a WSD run from a stable-phase checkpoint, launched as it was"),
}


def _usage() -> str:
    lines = ["usage: distaff COMMAND [ARGS ...] [--debug] [--verbose]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Bad input is one line and exit status 2; --debug (anywhere) adds the traceback of any error;",
              "--verbose (anywhere) shows the libraries' own INFO lines, progress bars and warnings."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = take_verbose_flag(take_debug_flag(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"distaff: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


def console_main() -> None:
    """The installed ``distaff`` script: ``main``, then :func:`distaff.train.core.distributed.exit_process` when
    the command imported it (only a process that did can have had a process group; the others, ``distaff plan``
    and ``--help`` among them, exit plainly without importing torch for it)."""
    code = main()
    distributed = sys.modules.get("distaff.train.core.distributed")
    if distributed is None:
        sys.exit(code)
    distributed.exit_process(code)


if __name__ == "__main__":
    console_main()
