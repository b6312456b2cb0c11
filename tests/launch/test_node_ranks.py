"""``python -m distaff.launch.node_ranks``: torchrun for one node's ranks, exiting with the status of the rank that
failed first, with no ChildFailedError traceback or torch elastic lines unless ``--verbose`` (DISTAFF_VERBOSE=1).
Real torchrun, real rank processes (a standalone rendezvous on this machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

TORCHRUN_NOISE = ("Traceback", "ChildFailedError", "Root Cause", "torch.distributed.elastic", "death signal")


@pytest.fixture(scope="module")
def rank_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank that says its one line and exits with its argument once both ranks have said theirs; rank 1 exits
    first when told to die."""
    path = tmp_path_factory.mktemp("ranks") / "rank.py"
    path.write_text(textwrap.dedent("""
        import os, signal, sys, time
        from pathlib import Path
        code, rank = sys.argv[1], int(os.environ["RANK"])
        if code == "kill":
            if rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)      # torchrun ends it once rank 1 is gone
        # one write(2) per line: the two ranks share the node's stderr, and a print's text and newline may go out
        # as two writes (unbuffered streams), which the other rank's line can split
        os.write(2, f"distaff: rank {rank}: its own line; exiting with {code}\\n".encode())
        # torchrun ends the other ranks as soon as one exits with an error: on a loaded machine rank 1 could still
        # be starting when rank 0 exits, and its line never written. Each waits (at most 30 s) for both lines.
        said = Path(__file__).parent / os.environ["TORCHELASTIC_RUN_ID"]
        said.mkdir(exist_ok=True)
        (said / str(rank)).touch()
        deadline = time.monotonic() + 30
        while len(list(said.iterdir())) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(int(code))
    """))
    return path


def _node(rank_script: Path, code: str, *, verbose: bool = False) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "DISTAFF_VERBOSE"}
    if verbose:
        env["DISTAFF_VERBOSE"] = "1"
    return subprocess.run([sys.executable, "-m", "distaff.launch.node_ranks", "--standalone", "--nproc-per-node=2",
                           "--max-restarts=0", "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", str(rank_script), code],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("code", [75, 76, 2])
def test_a_status_the_ranks_explain_is_the_nodes_with_their_lines_only(rank_script: Path, code: int) -> None:
    node = _node(rank_script, str(code))
    out = node.stdout + node.stderr
    assert node.returncode == code, out
    assert sorted(out.splitlines()) == [f"distaff: rank {rank}: its own line; exiting with {code}" for rank in (0, 1)]


def test_verbose_shows_torchruns_traceback_and_keeps_the_status(rank_script: Path) -> None:
    node = _node(rank_script, "76", verbose=True)
    assert node.returncode == 76 and "ChildFailedError" in node.stderr and "Traceback" in node.stderr, node.stderr


def test_a_rank_killed_by_a_signal_is_named_in_one_line(rank_script: Path) -> None:
    node = _node(rank_script, "kill")
    out = node.stdout + node.stderr
    assert node.returncode == 128 + 9, out
    assert "distaff: rank 1 was killed by SIGKILL" in out and not [n for n in TORCHRUN_NOISE if n in out], out


def test_any_other_status_is_named_with_its_rank(rank_script: Path) -> None:
    node = _node(rank_script, "3")
    out = node.stdout + node.stderr
    assert node.returncode == 3 and not [n for n in TORCHRUN_NOISE if n in out], out
    assert "exited with 3 (its own lines above say why)" in out, out
