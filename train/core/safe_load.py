"""Loading torch checkpoint files without running code from them: ``weights_only=True`` on every path.

DeepSpeed (0.19) loads its own files with ``torch.load(weights_only=False)`` both when resuming
(``TorchCheckpointEngine.load``) and in ``zero_to_fp32``, so a crafted optimizer-state file would run
code on unpickling. :func:`weights_only_loads` forces the restricted unpickler for every ``torch.load``
inside its block, allowing only the few DeepSpeed types its files hold.
"""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from distaff.train.core.errors import UserError


_TORCH_LOAD = torch.load  # the real one, kept while weights_only_loads replaces torch.load


class UnsafeCheckpointError(UserError):
    """A checkpoint file holds something other than tensors and plain (allow-listed) values."""


def _deepspeed_globals() -> list[type]:
    """The DeepSpeed types its ZeRO optimizer-state files pickle (found with ``get_unsafe_globals_in_checkpoint``)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def safe_load(path: str | Path, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True)``; a file needing more is an :class:`UnsafeCheckpointError` naming it."""
    kwargs.pop("weights_only", None)
    kwargs.setdefault("map_location", "cpu")
    try:
        with torch.serialization.safe_globals(_deepspeed_globals()):
            return _TORCH_LOAD(path, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        lines = str(err).splitlines()
        detail = next((line.strip() for line in lines if "WeightsUnpickler error" in line), lines[0] if lines else "")
        raise UnsafeCheckpointError(f"{path}: refusing to load, the file holds objects that are not plain weights "
                                    f"({detail})") from err


@contextmanager
def weights_only_loads() -> Iterator[None]:
    """Every ``torch.load`` inside the block (DeepSpeed's included) goes through :func:`safe_load`."""
    def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
        return safe_load(f, map_location=map_location, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = _TORCH_LOAD
