"""Batches of tokenised labelled examples for fine-tuning: shuffled, per rank, resumable; and eval batches.

A batch is a dict. The model's arguments (pass ``model(**model_inputs(batch))``):

* padded (``packed=False``), padded to the batch's longest example: ``input_ids`` and ``attention_mask``
  (long ``[B, L]``), ``token_type_ids`` (long ``[B, L]``, sentence pairs only), ``labels`` (``[B]``: long
  class ids, or float32 regression targets);
* packed (``packed=True``), the same examples concatenated without padding, in the layout
  :class:`~distaff.train.model.classifier.DebertaForSequenceClassification` pools the first token of each
  sequence from: ``input_ids``/``position_ids`` (long ``[T]``), ``token_type_ids`` (``[T]``, pairs
  only), ``cu_seqlens`` (int32 ``[B + 1]``), ``max_seqlen`` (int), ``labels`` (``[B]``).

And two extras for the trainer: ``example_ids`` (long ``[B]``: each row's index in the
:class:`~distaff.train.finetune.labelled.LabelledSet`, -1 for an eval filler row) and ``weights`` (float32
``[B]``: 1 for a real example, 0 for a filler).

:class:`TrainBatches` yields ``batch_size`` examples per rank per step forever, epoch after epoch. Each
epoch is a permutation of all examples drawn from ``(seed, epoch)``; step s of the epoch takes positions
``[s * world_size * batch_size, (s + 1) * world_size * batch_size)`` of it and rank r the r-th
``batch_size`` of those, so the ranks never share an example and ``steps_per_epoch = len(data) //
(world_size * batch_size)`` (the few left over differ every epoch). ``state_dict()`` taken after a batch
was consumed and given to ``load_state_dict()`` of a new iterator (same data, seed, batch size, world
size) continues with exactly the next batch. ``load_resized_state_dict()`` takes the states of all ranks
of a run with another world size and re-deals the rest of the epoch: the positions nobody has read are
dealt from an ``offset`` in steps of ``world_size * batch_size``, so no example of the epoch is read twice
or skipped (but the few that no longer fill a step, as at the end of any epoch).

:class:`EvalBatches` walks the whole dev set once in file order, split across ranks so that every example
is seen by exactly one rank; the last step is filled up with weight-0 copies of example 0 so every rank
runs the same number of batches of the same size (collectives line up). Gather ``logits``, ``labels``,
``weights`` (or ``example_ids``) from all ranks and keep the rows with weight 1
(:func:`distaff.train.finetune.metrics.compute_metrics` takes the weights); an eval loss should be the
weighted mean too, since the model's own ``loss`` averages over the fillers as well.

Sketch of a training loop::

    train = TrainBatches(data.train, batch_size=16, rank=rank, world_size=world, seed=seed, pad_id=tok.pad_id)
    train.load_state_dict(saved)                  # on resume, before iterating
    for step, batch in zip(range(total_steps), train):
        loss = engine(**model_inputs(batch)).loss
        ...
        save(..., train.state_dict())             # the position after this batch
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import torch

from distaff.train.core.errors import shown
from distaff.train.finetune.labelled import LabelledSet
from distaff.train.model.config import ConfigError

STATE_FORMAT = "distaff-labelled-batches/1"
# what a saved state must share with this run to continue it, and the config key that sets each
RESUME_KEYS = {"seed": "run.seed", "batch_size": "data.batch_size", "examples": "data.train",
               "fingerprint": "data.train"}
MODEL_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "cu_seqlens", "max_seqlen", "labels")


def model_inputs(batch: dict) -> dict:
    """The batch's entries that are the model's keyword arguments (the extras left out)."""
    return {key: value for key, value in batch.items() if key in MODEL_KEYS}


def collate(data: LabelledSet, indices: np.ndarray, weights: np.ndarray, pad_id: int, packed: bool) -> dict:
    """The examples ``indices`` of ``data`` as one batch, padded or packed (see the module docstring)."""
    ids = [data.input_ids[i] for i in indices]
    types = None if data.token_type_ids is None else [data.token_type_ids[i] for i in indices]
    labels = torch.from_numpy(data.labels[indices].astype(np.float32 if data.regression else np.int64))
    real = weights > 0
    extras = {"example_ids": torch.from_numpy(np.where(real, indices, -1).astype(np.int64)),
              "weights": torch.from_numpy(weights.astype(np.float32))}
    layout = _packed(ids, types) if packed else _padded(ids, types, pad_id)
    return {**layout, "labels": labels, **extras}


def _padded(ids: list[np.ndarray], types: list[np.ndarray] | None, pad_id: int) -> dict:
    lengths = np.array([len(row) for row in ids])
    inside = np.arange(lengths.max()) < lengths[:, None]
    input_ids = np.full(inside.shape, pad_id, dtype=np.int64)
    input_ids[inside] = np.concatenate(ids)
    batch = {"input_ids": torch.from_numpy(input_ids), "attention_mask": torch.from_numpy(inside.astype(np.int64))}
    if types is not None:
        token_types = np.zeros(inside.shape, dtype=np.int64)
        token_types[inside] = np.concatenate(types)
        batch["token_type_ids"] = torch.from_numpy(token_types)
    return batch


def _packed(ids: list[np.ndarray], types: list[np.ndarray] | None) -> dict:
    lengths = np.array([len(row) for row in ids])
    batch = {"input_ids": torch.from_numpy(np.concatenate(ids).astype(np.int64)),
             "position_ids": torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]).astype(np.int64)),
             "cu_seqlens": torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)),
             "max_seqlen": int(lengths.max())}
    if types is not None:
        batch["token_type_ids"] = torch.from_numpy(np.concatenate(types).astype(np.int64))
    return batch


def _check_rank(batch_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world_size {world_size}")


class TrainBatches:
    """Shuffled training batches of this rank, epoch after epoch, with exact resume."""

    def __init__(self, data: LabelledSet, *, batch_size: int, rank: int, world_size: int, seed: int, pad_id: int,
                 packed: bool = False):
        _check_rank(batch_size, rank, world_size)
        self.data, self.batch_size, self.rank, self.world_size = data, batch_size, rank, world_size
        self.seed, self.pad_id, self.packed = seed, pad_id, packed
        self.steps_per_epoch = len(data) // (batch_size * world_size)
        if self.steps_per_epoch == 0:
            raise ConfigError(f"{data.source}: {len(data)} training examples do not fill one step of batch_size "
                              f"{batch_size} x {world_size} ranks")
        # the next batch: step ``step`` of the deal that starts at position ``offset`` of epoch ``epoch``
        self.epoch, self.step, self.offset = 0, 0, 0
        self._fingerprint = data.fingerprint()

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of all examples (the same on every rank)."""
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.data))

    def _steps_in_deal(self) -> int:
        return (len(self.data) - self.offset) // (self.world_size * self.batch_size)

    def __iter__(self) -> Iterator[dict]:
        weights = np.ones(self.batch_size)
        while True:
            order = self.order(self.epoch)
            while self.step < self._steps_in_deal():
                start = self.offset + (self.step * self.world_size + self.rank) * self.batch_size
                indices = order[start:start + self.batch_size]
                self.step += 1  # counted before the caller sees the batch: state_dict() is "after it"
                yield collate(self.data, indices, weights, self.pad_id, self.packed)
            self.epoch, self.step, self.offset = self.epoch + 1, 0, 0

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "epoch": self.epoch, "step": self.step, "offset": self.offset,
                **self._identity()}

    def _identity(self) -> dict:
        return {"seed": self.seed, "batch_size": self.batch_size, "world_size": self.world_size,
                "examples": len(self.data), "fingerprint": self._fingerprint}

    def resume_problem(self, state: dict, checkpoint: str = "the checkpoint") -> str | None:
        """Why ``state`` (any rank's, from any world size) cannot continue in this iterator, naming the config
        key that differs and what to do; None if it can."""
        if state.get("format") != STATE_FORMAT:
            return f"not a {STATE_FORMAT} state (format {shown(state.get('format'))})"
        for key, setting in RESUME_KEYS.items():
            saved, mine = state.get(key), self._identity()[key]
            if saved != mine:
                what = (f"{key} {shown(saved)} in {checkpoint}, {mine} in this run" if key != "fingerprint" else
                        f"the examples of {checkpoint} differ from this run's (another file, tokenizer, max_len or "
                        "split)")
                return (f"{setting}: {what}; a fine-tuning run resumes only with the settings it started with: "
                        f"restore {setting}, or start over with checkpoint.resume=none (or another run.out_dir)")
        return None

    def load_state_dict(self, state: dict) -> None:
        """Continue after the batch ``state`` was taken at (same world size); call before iterating."""
        problem = self.resume_problem(state) or (None if state.get("world_size") == self.world_size else
                                                 f"saved on {state.get('world_size')} ranks, not {self.world_size}")
        if problem:
            raise ConfigError(problem)
        self.epoch, self.step, self.offset = int(state["epoch"]), int(state["step"]), int(state.get("offset", 0))

    def load_resized_state_dict(self, states: list[dict]) -> None:
        """Continue from the states of all ranks of a run with another world size: they stand at one position
        of the epoch (every rank reads one batch per step), whose unread rest is re-dealt to this world size."""
        positions = {(s.get("epoch"), s.get("step"), s.get("offset", 0)) for s in states}
        problem = next(filter(None, map(self.resume_problem, states)), None)
        if problem or len(positions) != 1:
            raise ConfigError(problem or f"the {len(states)} saved ranks stand at different positions "
                                         f"{sorted(positions)}; they cannot be re-dealt")
        (epoch, step, offset), = positions
        self.epoch, self.step = int(epoch), 0
        self.offset = int(offset) + int(step) * int(states[0]["world_size"]) * self.batch_size


class EvalBatches:
    """The dev set once, split across ranks, every example on exactly one rank (see the module docstring)."""

    def __init__(self, data: LabelledSet, *, batch_size: int, rank: int, world_size: int, pad_id: int,
                 packed: bool = False):
        _check_rank(batch_size, rank, world_size)
        self.data, self.batch_size, self.rank, self.world_size = data, batch_size, rank, world_size
        self.pad_id, self.packed = pad_id, packed
        self.steps = math.ceil(len(data) / (batch_size * world_size))

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[dict]:
        for step in range(self.steps):
            start = (step * self.world_size + self.rank) * self.batch_size
            slots = np.arange(start, start + self.batch_size)
            real = slots < len(self.data)
            yield collate(self.data, np.where(real, slots, 0), real.astype(np.float32), self.pad_id, self.packed)
