"""Launch sizing shared by the kernels that reduce weight/bias gradients without atomics."""

from __future__ import annotations

import torch


def reduction_programs(n_items: int, device: torch.device) -> int:
    """How many programs share a deterministic partial-sum reduction over ``n_items`` rows.

    A few waves of programs per SM on CUDA; two under the CPU interpreter, so tests still cover a
    program that owns several rows and one that owns the remainder.
    """
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 2
    return max(1, min(n_items, target))
