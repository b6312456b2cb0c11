"""Helpers shared by the tests: the device kernel tests run on, the bf16 rule, comparisons, a crafted pickle."""

from __future__ import annotations

import os

import pytest
import torch


def selected_device() -> torch.device:
    """CUDA when the suite runs with ``DISTAFF_TEST_GPU=1``; otherwise CPU (Triton's interpreter)."""
    return torch.device("cuda" if os.environ.get("DISTAFF_TEST_GPU") == "1" else "cpu")


# Marks a Triton case in bf16: the interpreter computes bf16 wrongly, so such cases run only on a GPU.
BF16_NEEDS_GPU = pytest.mark.skipif(
    selected_device().type != "cuda",
    reason="bf16 is not emulated correctly by TRITON_INTERPRET; runs with DISTAFF_TEST_GPU=1")
# The dtypes every Triton op is checked in.
TRITON_DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=BF16_NEEDS_GPU)]


def assert_same_loss_and_grads(fused, plain, *inputs, labels, **options) -> None:
    """Two models with the same weights (e.g. Triton and reference attention) give the same MLM loss
    and parameter gradients on ``inputs`` (``options``: further keywords of the forward, e.g. packing)."""
    losses = [model(*inputs, labels=labels, **options).loss for model in (fused, plain)]
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    for loss in losses:
        loss.backward()
    for (name, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=name)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float, what: str = "") -> None:
    """``actual`` (any dtype) against a float64 reference, elementwise; ``what`` names the tensor on failure."""
    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=atol,
                               msg=(lambda m: f"{what}: {m}") if what else None)


class CreatesMarker:
    """A crafted pickle payload: unpickling it calls ``open(marker, "w")``, so the file appearing means code ran."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self) -> tuple:
        return open, (str(self.marker), "w")


class StepCounter:
    """The smallest per-rank state a Checkpointer saves and restores: one integer."""

    value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
