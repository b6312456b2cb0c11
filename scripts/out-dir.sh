# Sourced by the demo scripts before they delete their output folder (`rm -rf "$OUT"`): distaff's own guard
# (distaff.train.core.files.check_apart) refuses, in one line with exit 2, an output folder that is, lies inside or
# contains one of the script's inputs (DISTAFF_DEMO_DIR=. would otherwise delete the repository's data).
#   refuse_out_over_inputs SCRIPT PYTHON OUT INPUT...
refuse_out_over_inputs() {
    "$2" - "$@" <<'PYEOF'
import sys

from distaff.train.core.errors import command_main
from distaff.train.core.files import check_apart


def check(argv: list[str]) -> int:
    out, inputs = argv[2], argv[3:]
    check_apart(("output folder", out), [("input", path) for path in inputs])
    return 0


sys.exit(command_main(sys.argv[1], check, sys.argv[1:]))
PYEOF
}
