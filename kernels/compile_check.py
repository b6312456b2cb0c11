"""``python -m distaff.kernels.compile_check``: the command keeps its name; the check lives in
``distaff.kernels.aot.compile_check`` with the other ahead-of-time tools."""

import sys

from distaff.kernels.aot.compile_check import main

if __name__ == "__main__":
    sys.exit(main())
