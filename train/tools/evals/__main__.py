"""``python -m distaff.train.tools.evals``: ``distaff evals`` (train/tools/evals/cli.py)."""

from distaff.train.core.distributed import exit_process
from distaff.train.tools.evals.cli import main

exit_process(main())
