"""2 CPU ranks under torchrun with real DeepSpeed ZeRO on real text: the loss goes down, outputs are written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pretrain_fixtures import metrics, prepare_data, run_log, torchrun, train_losses, write_config

pytestmark = pytest.mark.integration


def zero_run(base: Path, sample_data: Path, stage: int) -> Path:
    """A finished 2-rank run at ZeRO ``stage`` (cached per session: test_export uses the ZeRO-3 one, test_average
    all three runs' last three checkpoints)."""
    out = base / f"zero{stage}-run"
    if (out / "summary.json").is_file():
        return out
    data = prepare_data(base, sample_data)
    config = write_config(base / f"zero{stage}.yaml", data, out, zero={"stage": stage}, train={"max_steps": 16},
                          checkpoint={"every": 4, "keep": 3}, eval={"every": 8, "batches": 4})
    proc = torchrun(config, base)
    assert proc.returncode == 0, run_log(proc)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_run_learns_and_writes_its_outputs(stage, sample_data, tmp_path_factory):
    out = zero_run(tmp_path_factory.getbasetemp(), sample_data, stage)
    losses = train_losses(out)
    assert sorted(losses) == list(range(1, 17))
    first, last = sum(losses[s] for s in (1, 2, 3)) / 3, sum(losses[s] for s in (14, 15, 16)) / 3
    assert last < first - 0.5, losses   # from ~ln(1000) = 6.9 down

    records = metrics(out)
    train = [r for r in records if "loss" in r]
    assert all({"lr", "accuracy", "grad_norm", "tokens_per_s", "samples_per_s", "peak_mem_gb"} <= r.keys() for r in train)
    assert train[0]["lr"] < train[2]["lr"]            # warmup
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [8, 16] and evals[1]["eval_loss"] < evals[0]["eval_loss"] + 0.5

    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["zero"]["stage"] == stage and resolved["model"]["hidden_size"] == 64
    assert resolved["model"]["vocab_size"] == 1000           # taken from the tokenizer
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 16 and summary["positions"] == 16 * 2 * 4 * 64 and summary["packing"] == "padded"
    # tokens are real tokens: the packed rows hold a little padding (a document's last row is short)
    assert 0.8 * summary["positions"] < summary["tokens"] <= summary["positions"]
    assert summary["padding_fraction"] == pytest.approx(1 - summary["tokens"] / summary["positions"])
    assert 0 < summary["unigram_baseline_accuracy"] < 0.2
    assert (out / "metrics.png").stat().st_size > 1000
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert ckpts == ["step-00000008", "step-00000012", "step-00000016"]   # keep=3 pruned step 4
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-00000016"
