"""A disk that fills up during a checkpoint save (issue 15, item 8): the save fails with "no space left on <path>
while saving step N; previous checkpoint step M is intact", the partial save is removed, ``latest`` still names
step M, and a run resumes from it.

The real case mounts a 4 MB tmpfs as the run folder inside a private user + mount namespace (``unshare -rm``:
no root needed, nothing to unmount, the mount vanishes with the process), where the second checkpoint does
not fit. Where user namespaces are not permitted that test skips; the other writes into ``/dev/full``, which
always fails with ENOSPC, and runs everywhere.
"""

from __future__ import annotations

import errno
import json
import re
import subprocess
from pathlib import Path

import pytest

from helpers import StepCounter
from pretrain_fixtures import PYTHON, namespaces_permitted, prepare_data, rank_env, write_config

from distaff.train.core.distributed import free_port
from distaff.train.pretrain.trainer import EXIT_FAILURE
from distaff.train.run.checkpoint import META, Checkpointer, CheckpointSaveError, tag_for_step
from distaff.train.run.checkpoint_files import checkpoint_problem

MESSAGE = r"no space left on {where} \([\d,]+ bytes free\) while saving step {step}; previous checkpoint step {prev} is intact"


class _FullDiskEngine:
    """Writes a real file per save, then (from save ``fail_from`` on) writes into /dev/full, as a full disk fails."""

    def __init__(self, fail_from: int) -> None:
        self.saves, self.fail_from = 0, fail_from

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        self.saves += 1
        folder = Path(save_dir) / tag
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "weights.bin").write_bytes(b"w" * 4096)
        if self.saves >= self.fail_from:
            with open("/dev/full", "wb", buffering=0) as full:
                full.write(b"x" * 4096)

    def load_checkpoint(self, load_dir: str, tag: str, **options) -> tuple[str, dict]:
        return load_dir, {}


@pytest.mark.unit
def test_enospc_during_a_save_names_the_intact_previous_checkpoint(tmp_path):
    checkpointer = Checkpointer(tmp_path, _FullDiskEngine(fail_from=2), per_rank={"s": StepCounter()}, shared={},
                                meta={}, every=3, keep=2, rank=0, world_size=1, barrier=lambda: None)
    checkpointer.maybe_save(3)
    with pytest.raises(CheckpointSaveError) as raised:
        checkpointer.maybe_save(6)
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == errno.ENOSPC
    assert re.fullmatch(MESSAGE.format(where=re.escape(str(tmp_path)), step=6, prev=3) + r" \(.*step-00000003\)",
                        str(raised.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", tag_for_step(3)]   # no partial left
    assert (tmp_path / "latest").read_text().strip() == tag_for_step(3)
    assert checkpoint_problem(tmp_path / tag_for_step(3)) is None


@pytest.mark.integration
@pytest.mark.timeout(300)
@pytest.mark.skipif(not namespaces_permitted(), reason="unshare -rm (user + mount namespace) is not permitted "
                    "here, so no private tmpfs can be mounted; the /dev/full test covers the save path")
def test_full_filesystem_during_a_real_save(sample_data, tmp_path_factory):
    data = prepare_data(tmp_path_factory.getbasetemp(), sample_data)
    tmp = tmp_path_factory.mktemp("disk-full")
    run, copy = tmp / "run", tmp / "after"
    run.mkdir(), copy.mkdir()
    config = write_config(tmp / "run.yaml", data, run, train={"max_steps": 6}, checkpoint={"every": 2, "keep": 2},
                          wandb={"mode": "disabled"}, logging={"every": 1, "progress_bar": False, "plot": False})
    rank_vars = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}
    # the run folder is a 4 MB tmpfs: one checkpoint (~2.8 MB) fits, the second does not
    script = ('mount -t tmpfs -o size=4m tmpfs "$RUN" || exit 99; '
              '"$PY" -m distaff.train.pretrain --config "$CFG"; code=$?; cp -a "$RUN/." "$COPY/"; exit $code')
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=240,
                          cwd=tmp, env={**rank_env(tmp), **rank_vars, "RUN": str(run), "COPY": str(copy),
                                        "PY": PYTHON, "CFG": str(config)})
    log = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_FAILURE, log[-6000:]
    where = re.escape(str(run / "checkpoints"))
    assert re.search("distaff pretrain: " + MESSAGE.format(where=where, step=4, prev=2), log), log[-6000:]

    checkpoints = copy / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == tag_for_step(2)
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == [tag_for_step(2)]   # no partial
    assert checkpoint_problem(checkpoints / tag_for_step(2)) is None
    assert json.loads((checkpoints / tag_for_step(2) / META).read_text())["step"] == 2

    # with space again, the run resumes from step 2 and finishes
    rank_vars["MASTER_PORT"] = str(free_port())
    resumed = subprocess.run([PYTHON, "-m", "distaff.train.pretrain", "--config", str(config),
                              f"run.out_dir={copy}"], capture_output=True, text=True, timeout=240, cwd=tmp,
                             env={**rank_env(tmp), **rank_vars})
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-6000:]
    assert f"resuming from {checkpoints / tag_for_step(2)}" in resumed.stdout
