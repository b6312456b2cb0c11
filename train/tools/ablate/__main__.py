"""``python -m distaff.train.tools.ablate``: ``distaff ablate``."""

import sys

from distaff.train.tools.ablate.cli import main

sys.exit(main())
