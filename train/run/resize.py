"""Resuming a checkpoint on a different number of ranks.

ZeRO (stages 1-3, and bf16 at any stage) splits the optimizer state into one file per rank, so a
checkpoint written by N ranks cannot be read by M ranks as it is. When the world size differs,
rank 0 converts the checkpoint once into DeepSpeed's *universal* format (one folder per parameter
holding its fp32 weights and Adam moments, `deepspeed.checkpoint.ds_to_universal`), inside the
checkpoint as ``universal/``; every rank then loads its own new partition from there. Conversion
writes into ``.partial-universal`` and renames it when done, so an interrupted conversion is
redone, never half-used. Every ``torch.load`` on the way is restricted to plain weights
(``safe_load.py``). Without partitioned state (ZeRO-0 in fp32/fp16) every rank reads the full
state and DeepSpeed loads it on any world size directly.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from distaff.train.core.errors import UserError
from distaff.train.core.files import fsync_dir
from distaff.train.core.safe_load import weights_only_loads
from distaff.train.data.errors import DataError

UNIVERSAL = "universal"
_PARTIAL_UNIVERSAL = ".partial-universal"


def has_partitioned_state(folder: Path) -> bool:
    """Whether the checkpoint's optimizer state is split over its ranks (ZeRO or DeepSpeed's bf16 optimizer)."""
    return any(folder.glob("*zero_pp_rank_*_optim_states.pt"))


def _convert(folder: Path, out: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(folder), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    chatter = io.StringIO()  # the converter prints progress bars; keep them for an error message only
    try:
        with weights_only_loads(), contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)
    except Exception as err:
        refusal = _refusal(err)
        if refusal is not None:     # a pickled payload: the one-line refusal, not the converter's chatter
            raise refusal from None
        raise RuntimeError(f"{folder}: converting to DeepSpeed's universal checkpoint failed: {err}\n"
                           f"{chatter.getvalue()[-2000:]}") from err
    finally:
        (folder / "latest_universal").unlink(missing_ok=True)  # the converter's own marker; we name the tag


def _refusal(err: BaseException) -> UserError | None:
    """Our refusal to unpickle (or other bad-input error) wherever the converter's worker re-raised it."""
    seen = err
    while seen is not None:
        if isinstance(seen, UserError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def universal_folder(folder: Path, rank: int, barrier: Callable[[], None],
                     report: Callable[[str], None] = print,
                     from_rank0: Callable[[str], str] = lambda text: text) -> Path:
    """``folder/universal``, converted by rank 0 if it is not there yet; collective. A checkpoint rank 0 refuses
    to convert (a pickled payload) is the same one-line :class:`DataError` on every rank (``from_rank0``: rank 0's
    text on every rank), not one rank's error and the others' lost connection."""
    done, refusal = folder / UNIVERSAL, ""
    if rank == 0 and not done.is_dir():
        partial = folder / _PARTIAL_UNIVERSAL
        shutil.rmtree(partial, ignore_errors=True)
        report(f"distaff: converting {folder} to a universal checkpoint (its optimizer state is split by rank)")
        try:
            _convert(folder, partial)
            os.replace(partial, done)
            fsync_dir(folder)
        except UserError as err:
            refusal = str(err)
    refusal = from_rank0(refusal)
    if refusal:
        raise DataError(refusal)
    barrier()
    if not done.is_dir():
        raise FileNotFoundError(f"{done}: rank 0's universal checkpoint is not visible here; "
                                "is the checkpoint folder shared by all nodes?")
    return done


@contextmanager
def universal_loading(engine) -> Iterator[None]:
    """Make ``engine.load_checkpoint`` read a universal checkpoint. DeepSpeed reads the switch from its
    config (``checkpoint.load_universal``) only while loading, so it is on for this block alone."""
    config = engine._config
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = before


def global_batch_notice(saved_config: dict, config: dict, saved_world: int, world: int) -> str:
    """What a resize does to the global batch (``data.batch_size x train.grad_accum x ranks``), and the
    ``train.grad_accum`` that keeps it, when there is one."""
    def global_batch(values: dict, ranks: int) -> int:
        return values["data"]["batch_size"] * values["train"]["grad_accum"] * ranks

    before, after = global_batch(saved_config, saved_world), global_batch(config, world)
    notice = (f"distaff: resuming a {saved_world}-rank checkpoint on {world} rank(s): global batch {before} -> "
              f"{after} samples (data.batch_size x train.grad_accum x ranks)")
    keep, rest = divmod(before, config["data"]["batch_size"] * world)
    if after != before and rest == 0:
        notice += f"; train.grad_accum={keep} keeps it at {before}"
    return notice
