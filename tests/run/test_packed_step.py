"""The train step on packed micro-batches: gradients of the mean over every labelled token of the step,
and counts of real tokens, samples and computed positions."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from distaff.train.core.distributed import free_port
from distaff.train.model.config import ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.pretrain.objectives import MaskedLMObjective
from distaff.train.run.config import RunConfig
from distaff.train.run.steps import batch_counts, train_step
from test_model_packed import BASE, pack, padded_batch

pytestmark = pytest.mark.unit


class AccumulatingEngine:
    """What train_step needs of a DeepSpeed engine on one rank: backward divides by grad_accum."""

    def __init__(self, model: torch.nn.Module, grad_accum: int):
        self.model, self.grad_accum = model, grad_accum

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> None:
        pass

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        pass


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_packed_micro_batches_give_the_gradient_of_the_token_mean(one_rank_group):
    torch.manual_seed(0)
    model = DebertaForMaskedLM(ModelConfig(**{**BASE, "emd": True}))
    whole = copy.deepcopy(model)
    ids, mask, labels = padded_batch(BASE["vocab_size"], lengths=(40, 29, 4, 17, 33))
    labels[:2, ::2] = ids[:2, ::2].where(mask[:2, ::2].bool(), labels[:2, ::2])  # uneven label counts
    first, second = pack(ids[:2], mask[:2], labels[:2]), pack(ids[2:], mask[2:], labels[2:])
    objective = MaskedLMObjective(RunConfig(), model.config)
    sums = train_step(AccumulatingEngine(model, 2), iter([first, second]), 2, torch.device("cpu"), objective,
                      world_size=1)
    whole(**pack(ids, mask, labels)).loss.backward()
    for (name, got), (_, want) in zip(model.named_parameters(), whole.named_parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-6, rtol=1e-4, msg=name)
    real = int(mask.sum())
    assert sums[3:].tolist() == [real, 5, real]  # real tokens, samples, positions: no padding


def test_padded_batches_count_real_tokens_and_padded_positions():
    ids, mask, labels = padded_batch(BASE["vocab_size"])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    assert batch_counts(batch) == [int(mask.sum()), ids.shape[0], ids.numel()]
    assert batch_counts(pack(ids, mask, labels)) == [int(mask.sum()), ids.shape[0], int(mask.sum())]
