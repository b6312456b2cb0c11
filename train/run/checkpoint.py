"""Atomic, resumable checkpoints of a run's stateful components, and when to take them.

Layout under ``<run.out_dir>/checkpoints``::

    step-00000100/            a complete checkpoint (DeepSpeed files, then ours)
        distaff/rank-00000.json   per rank: step and the per-rank components (data stream, RNG)
        distaff/meta.json         step, world size, configs and the shared components
        distaff/files.json        written last: every other file's size and sha256, meta.json's too
                                  (checkpoint_files.py), checked before resuming or exporting
        tokenizer/                copy of the tokenizer, so a checkpoint exports on its own
    latest                    text file naming the newest complete checkpoint
    .partial-step-00000200/   a save in progress (or interrupted by a crash)

A save writes everything into ``.partial-<tag>``, and only when every rank has finished does
rank 0 write ``meta.json`` and the file list, rename the folder to ``<tag>`` and atomically replace ``latest``. A
crash at any point before the rename leaves the previous checkpoint complete and named by
``latest``. Our state is JSON; DeepSpeed's own files are loaded with ``weights_only=True``
(``safe_load.py``), so nothing here runs code from a checkpoint.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import json
import os
import random
import resource
import shutil
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from distaff.train.core.errors import RunFailure, shown
from distaff.train.core.files import atomic_write_text, fsync_dir
from distaff.train.core.safe_load import weights_only_loads
from distaff.train.data.errors import DataError
from distaff.train.core.files import read_json
from distaff.train.run.checkpoint_files import (FORMAT_WITH_META_LISTED, META, checkpoint_problem, is_complete,
                                               read_meta, tag_for_step, write_file_list)
from distaff.train.run.resize import global_batch_notice, has_partitioned_state, universal_folder, universal_loading

LATEST = "latest"
PARTIAL_PREFIX = ".partial-"
STALE_PREFIX = ".stale-"
FORMAT_VERSION = FORMAT_WITH_META_LISTED


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _rank_file(folder: Path, rank: int) -> Path:
    return folder / "distaff" / f"rank-{rank:05d}.json"


# ---------------------------------------------------------------- finding checkpoints

def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint under ``root`` named by ``latest``, else the highest complete ``step-*``, else None.
    A ``latest`` that leads out of ``root`` (a path, or a link to another run's checkpoint) is a DataError:
    a run resumes from its own checkpoints only."""
    root = Path(root)
    marker = root / LATEST
    if marker.is_file():
        name = marker.read_text(errors="replace").strip()
        # checked before any path is made of it: a NUL byte would make Path.resolve raise
        if not name.startswith("step-") or not name.isprintable() or (root / name).resolve().parent != root.resolve():
            raise DataError(f"{marker}: names {shown(name)}, which is not a checkpoint folder inside {root}; a run "
                            f"resumes from its own checkpoints only: delete {marker} (the newest complete step-* "
                            "is then used) or set checkpoint.resume to a checkpoint folder")
        if is_complete(root / name):
            return root / name
    complete = [p for p in root.glob("step-*") if is_complete(p)]
    return max(complete, key=lambda p: p.name) if complete else None


def rank_state(folder: Path, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s per-rank components (data stream position, RNG) saved in checkpoint ``folder``."""
    path = _rank_file(folder, rank)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: rank {rank}'s state is missing from the checkpoint")
    state = read_json(path, error=DataError)
    if not isinstance(state, dict):
        raise DataError(f"{path}: expected a JSON object of rank {rank}'s state")
    return state


def newest_sound_checkpoint(root: Path, report: Callable[[str], None]) -> Path | None:
    """The latest checkpoint if its files match their record, else the newest complete one that does;
    each checkpoint passed over is reported with the reason."""
    latest = latest_checkpoint(root)
    if latest is None:
        return None
    others = sorted((p for p in root.glob("step-*") if is_complete(p) and p != latest), key=lambda p: p.name)
    for folder in [latest, *reversed(others)]:
        problem = checkpoint_problem(folder)
        if problem is None:
            return folder
        report(f"distaff: skipping checkpoint {folder}: {problem}")
    return None


def resolve_resume(resume: str, root: Path, report: Callable[[str], None] = print,
                   branch_from: str = "") -> Path | None:
    """``checkpoint.resume``: ``auto`` the newest sound checkpoint under ``root`` (none: ``branch_from``'s
    checkpoint when given, else None), ``none`` None, else the checkpoint folder it names (which must be sound)."""
    if resume == "none":
        return None
    if resume == "auto":
        found = newest_sound_checkpoint(root, report)
        return sound_checkpoint(branch_from, "checkpoint.branch_from") if found is None and branch_from else found
    return sound_checkpoint(resume, "checkpoint.resume")


def sound_checkpoint(path: str, key: str) -> Path:
    """The checkpoint folder ``path`` (the value of config ``key``), complete and matching its file list."""
    folder = Path(path)
    if not is_complete(folder):
        raise FileNotFoundError(f"{key}={path!r}: not a complete checkpoint (no {META} in it)")
    problem = checkpoint_problem(folder)
    if problem:
        raise FileNotFoundError(f"{key}={path!r}: damaged checkpoint: {problem}")
    return folder


# ---------------------------------------------------------------- the global RNGs as a component

def _tensor_to_b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _b64_to_byte_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


class RNGState:
    """Python, NumPy and torch (CPU and CUDA) generator states, as JSON-serialisable values.

    After a resize there is no saved state for this rank to continue: every rank then seeds its
    generators from a hash of all saved states and its own rank (distinct per rank, reproducible).
    """

    def __init__(self, rank: int = 0):
        self.rank = rank

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        algo, keys, pos, has_gauss, cached = np.random.get_state()
        state = {
            "python": [version, list(internal), gauss],
            "numpy": [algo, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": _tensor_to_b64(torch.get_rng_state()),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = _tensor_to_b64(torch.cuda.get_rng_state())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        algo, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((algo, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(_b64_to_byte_tensor(state["torch"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(_b64_to_byte_tensor(state["cuda"]))

    def load_resized_state_dict(self, states: list[dict[str, Any]]) -> None:
        text = json.dumps({"saved": states, "rank": self.rank}, sort_keys=True)
        seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)


# ---------------------------------------------------------------- the checkpointer

def remove_partial(root: Path) -> None:
    """Delete leftovers of interrupted saves and replacements."""
    for leftover in [*root.glob(PARTIAL_PREFIX + "*"), *root.glob(STALE_PREFIX + "*")]:
        shutil.rmtree(leftover, ignore_errors=True)


def prune(root: Path, keep: int, published: Path | None = None) -> None:
    """Delete all but the ``keep`` newest complete checkpoints, only once the newest is verified
    (a damaged newest checkpoint must not cost the older good ones). ``published``, the checkpoint
    this process has just written and recorded, is known good: it is not hashed a second time."""
    complete = sorted((p for p in root.glob("step-*") if is_complete(p)), key=lambda p: p.name)
    if not complete or (complete[-1] != published and checkpoint_problem(complete[-1]) is not None):
        return
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


class CheckpointSaveError(RunFailure):
    """A checkpoint could not be written; the message names the cause and the intact previous checkpoint."""


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NEARLY_FULL_BYTES = 64 << 20


def _failure(write: Callable[[], Any]) -> BaseException | None:
    """What ``write()`` raised, if anything (ours or DeepSpeed's, which torch may turn into a RuntimeError)."""
    try:
        write()
    except Exception as err:  # noqa: BLE001 - every rank must learn of it before anyone raises
        return err
    return None


def _file_size_limit() -> int | None:
    """This process's limit on the size of a file it writes (``ulimit -f``, RLIMIT_FSIZE), in bytes; None if none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def _save_failure_cause(err: BaseException, root: Path) -> str:
    """"no space left on <path>" for a full disk or quota, "a file reached the file-size limit" for EFBIG: torch's
    zip writer reports either only as "unexpected pos N vs M", so a failed write on a filesystem that is now
    (nearly) full counts as the first, and one under a finite ``ulimit -f`` as the second."""
    chain = [err, *(e for e in (err.__cause__, err.__context__) if e is not None)]
    oserror = next((e for e in chain if isinstance(e, OSError)), None)
    where = Path(oserror.filename) if oserror is not None and oserror.filename else root
    if (oserror is not None and oserror.errno in _NO_SPACE) or shutil.disk_usage(root).free < _NEARLY_FULL_BYTES:
        return f"no space left on {where} ({shutil.disk_usage(root).free:,} bytes free)"
    limit = _file_size_limit()
    if (oserror is not None and oserror.errno == errno.EFBIG) or (limit is not None and "unexpected pos" in str(err)):
        shown_limit = f"{limit:,} bytes" if limit is not None else "a limit of the filesystem"
        return (f"a file reached the file-size limit ({shown_limit}; `ulimit -f`) under {where}; raise it (ulimit -f "
                "unlimited in the job script) or save to a filesystem without one")
    if oserror is not None:
        return f"{oserror.strerror or oserror} on {where}"
    return f"{type(err).__name__}: {err}"


def publish(partial: Path, final: Path) -> None:
    """Rename a finished ``partial`` folder to ``final`` (replacing an older save of the same step)
    and point ``latest`` at it."""
    if final.exists():  # re-saving a step (e.g. after resuming from an older checkpoint)
        stale = final.with_name(STALE_PREFIX + final.name)
        os.replace(final, stale)
        os.replace(partial, final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(partial, final)
    fsync_dir(final.parent)
    atomic_write_text(final.parent / LATEST, final.name + "\n")


class Checkpointer:
    """Saves and restores the DeepSpeed engine plus named components, and decides when to save.

    ``per_rank`` components (data stream position, RNG) are stored once per rank; ``shared`` ones
    (the loop's counters) are the same on every rank and stored once, in ``meta.json``, with
    ``meta`` (configs). Every method is collective: all ranks call it at the same step.
    """

    def __init__(self, root: Path, engine, *, per_rank: dict[str, Stateful], shared: dict[str, Stateful],
                 meta: dict[str, Any], every: int, keep: int, rank: int, world_size: int,
                 barrier: Callable[[], None], any_rank: Callable[[bool], bool] = lambda flag: flag,
                 from_rank0: Callable[[str], str] = lambda text: text, tokenizer_dir: Path | None = None):
        self.root, self.engine = root, engine
        self.per_rank, self.shared, self.meta = per_rank, shared, meta
        self.every, self.keep = every, keep
        self.rank, self.world_size, self.barrier = rank, world_size, barrier
        self.any_rank = any_rank  # collective "is the flag set on any rank?"
        self.from_rank0 = from_rank0  # collective: rank 0's text on every rank
        self.tokenizer_dir = tokenizer_dir
        self.saved_step: int | None = None

    # ---- when
    def maybe_save(self, step: int, *, signalled: bool = False, last: bool = False) -> None:
        """Save on a signal, at the last step, and every ``every`` steps; never twice for one step."""
        due = signalled or last or (self.every > 0 and step % self.every == 0)
        if due and step != self.saved_step:
            self.save(step)

    # ---- saving
    def save(self, step: int) -> Path:
        """Write every component into ``.partial-<tag>``, then publish it as ``<tag>``."""
        partial = self.root / (PARTIAL_PREFIX + tag_for_step(step))
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
        self.barrier()
        self._check_saved(partial, step, _failure(lambda: self._write_rank_files(partial, step)))
        final = self.root / tag_for_step(step)
        failure = None
        if self.rank == 0:
            failure = _failure(lambda: (self._write_meta(partial, step), publish(partial, final)))
        self._check_saved(partial, step, failure)
        if self.rank == 0:
            prune(self.root, self.keep, published=final)
        self.barrier()
        self.saved_step = step
        return final

    def _check_saved(self, partial: Path, step: int, failure: BaseException | None) -> None:
        """Collective: when a rank failed to write its part, every rank removes nothing but the partial save
        (the previous checkpoint stays named by ``latest``) and raises :class:`CheckpointSaveError`."""
        if not self.any_rank(failure is not None):
            return
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        self.barrier()
        previous = latest_checkpoint(self.root)
        intact = (f"previous checkpoint step {read_meta(previous)['step']} is intact "
                  f"({previous})" if previous else "there is no previous checkpoint")
        cause = _save_failure_cause(failure, self.root) if failure else "another rank failed (see its error)"
        raise CheckpointSaveError(f"{cause} while saving step {step}; {intact}") from failure

    def _write_rank_files(self, partial: Path, step: int) -> None:
        """This rank's share: its DeepSpeed files and its per-rank components."""
        self.engine.save_checkpoint(str(partial.parent), tag=partial.name, save_latest=False)
        own = _rank_file(partial, self.rank)
        own.parent.mkdir(parents=True, exist_ok=True)
        states = {name: component.state_dict() for name, component in self.per_rank.items()}
        atomic_write_text(own, json.dumps({"step": step, **states}))

    def _write_meta(self, partial: Path, step: int) -> None:
        """The tokenizer copy and ``meta.json``, then the file list that records them with every other file."""
        if self.tokenizer_dir is not None:
            shutil.copytree(self.tokenizer_dir, partial / "tokenizer")
        states = {name: component.state_dict() for name, component in self.shared.items()}
        meta = {"format": FORMAT_VERSION, "step": step, "world_size": self.world_size, **self.meta, **states}
        atomic_write_text(partial / META, json.dumps(meta, indent=1))
        write_file_list(partial)

    # ---- restoring
    def restore_chosen(self, folder: Path | None) -> Path | None:
        """Load ``folder``, the checkpoint every rank chose and verified before the engine was built
        (``resume_check.check_resumable``), if any; rank 0 clears interrupted saves."""
        if self.rank == 0 and self.root.is_dir():
            remove_partial(self.root)
        if folder is not None:
            self.load(folder)
        return folder

    def load(self, folder: Path) -> None:
        """Restore the engine and every component from ``folder``, written by this world size or another."""
        meta = read_meta(folder)
        saved_world = meta["world_size"]
        if saved_world == self.world_size:
            per_rank = {name: [state] for name, state in self._rank_state(folder, self.rank).items()}
        else:
            if self.rank == 0 and "config" in meta and "config" in self.meta:
                print(global_batch_notice(meta["config"], self.meta["config"], saved_world, self.world_size),
                      flush=True)
            saved = [self._rank_state(folder, rank) for rank in range(saved_world)]
            per_rank = {name: [state[name] for state in saved] for name in self.per_rank}
        self._load_engine(folder, resized=saved_world != self.world_size)
        for name, component in self.per_rank.items():
            if len(per_rank[name]) == 1:
                component.load_state_dict(per_rank[name][0])
            else:
                component.load_resized_state_dict(per_rank[name])
        for name, component in self.shared.items():
            component.load_state_dict(meta[name])
        self.saved_step = meta["step"]

    def _rank_state(self, folder: Path, rank: int) -> dict[str, Any]:
        state = rank_state(folder, rank)
        missing = sorted(set(self.per_rank) - set(state))
        if missing:
            raise DataError(f"{_rank_file(folder, rank)}: no state for {missing}")
        return state

    def _load_engine(self, folder: Path, resized: bool) -> None:
        """DeepSpeed's files; a checkpoint whose optimizer state is split over another number of ranks is
        read through its universal form (resize.py)."""
        load_dir, tag, universal = folder.parent, folder.name, contextlib.nullcontext()
        if resized and has_partitioned_state(folder):
            report = print if self.rank == 0 else lambda message: None
            load_dir, tag = folder, universal_folder(folder, self.rank, self.barrier, report, self.from_rank0).name
            universal = universal_loading(self.engine)
        with universal, weights_only_loads():  # DeepSpeed's checkpoint engine would unpickle with weights_only=False
            loaded, _ = self.engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                                    load_lr_scheduler_states=False)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {folder}")
