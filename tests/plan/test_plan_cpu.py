"""The cpu device kind: the probe's cache, per-core figures from --gpu-spec, and the CPU time model's parts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distaff.train.core.errors import ConfigError
from distaff.train.plan import cli, cpu
from distaff.train.plan.cpu_time import gemm_rate
from distaff.train.plan.gpus import parse_spec
from distaff.train.plan.planner import devices, make_plan
from distaff.train.run.config import load_config

REPO = Path(__file__).resolve().parents[2]

SPEC = "name=cpu,tflops=0.2,fp32_tflops=0.08,hbm_tb_s=0.01,cores=4,memory_gib=16"


@pytest.mark.unit
def test_the_probe_is_cached_per_machine_and_measured_again_when_it_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(cpu, "probe", lambda: calls.append(1) or {"version": cpu.PROBE_VERSION,
                                                                   "machine": cpu.machine_key(), "gemm_gflops": [[128, 10, 20]],
                                                                   "copy_gb_s": 5.0, "cores": 2,
                                                                   "memory_bytes": 8e9})
    first = cpu.probed()
    assert cpu.probed() == first and len(calls) == 1 and json.loads(cpu.cache_path().read_text()) == first
    cpu.cache_path().write_text(json.dumps({**first, "machine": "another CPU"}))
    cpu.probed()
    assert len(calls) == 2                                    # another machine's cache is measured again
    cpu.probed(refresh=True)
    assert len(calls) == 3


@pytest.mark.unit
def test_cpu_ranks_share_the_cores_given_per_core_by_gpu_spec(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    per_core = parse_spec(SPEC)
    assert per_core.is_cpu and per_core.cores == 4 and per_core.gemm_curve == ((1, 80.0, 200.0),)
    two, kind = devices("2xcpu", per_core)
    assert two == 2 and kind.threads == 2 and kind.fp32_tflops == pytest.approx(0.16)
    assert kind.memory_gib == pytest.approx(8.0)
    assert devices("8xcpu", per_core)[1].threads == 1       # more ranks than cores: one thread each
    # the threads a run really uses: OMP_NUM_THREADS when set (what a running rank exported), at most the share
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    one = devices("2xcpu", per_core)[1]
    assert one.threads == 1 and one.fp32_tflops == pytest.approx(0.08)
    monkeypatch.setenv("OMP_NUM_THREADS", "16")
    assert devices("1xcpu", per_core)[1].threads == 4
    with pytest.raises(ConfigError, match="give the per-core figures fp32_tflops, hbm_tb_s, cores"):
        parse_spec("name=cpu,tflops=1")
    assert gemm_rate(((128, 10, 40), (1024, 40, 80)), 362, "fp32") == pytest.approx(25e9, rel=1e-3)   # log-linear
    assert gemm_rate(((128, 10, 40), (1024, 40, 80)), 64, "bf16") == 40e9


@pytest.mark.unit
def test_a_cpu_plan_has_every_part_and_stage_and_reads_the_prepared_vocabulary(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # an in-process run earlier in this worker may have set it
    fixture = json.loads((REPO / "tests/run/fixtures/checkpoint-bda9efe/data/manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**fixture, "seq_len": 64, "vocab_size": 1000}))
    prepared = make_plan(load_config("tiny-cpu", [f"data.dir={tmp_path}"]), "2xcpu", gpu_spec=parse_spec(SPEC))
    assert prepared.setting.seq_len == 64 and prepared.setting.models[0].vocab_size == 1000   # as the trainer builds it
    cfg = load_config("tiny-cpu")
    plan = make_plan(cfg, "2xcpu", seq_len=128, gpu_spec=parse_spec(SPEC))
    assert all(plan.time.parts[part] > 0 for part in ("GEMMs", "attention", "fused ops", "optimizer"))
    assert plan.time.stages["forward"] < plan.time.stages["backward"] and plan.time.stages["data wait"] == 0
    assert sum(plan.time.stages.values()) == pytest.approx(plan.time.total)
    assert not plan.setting.fused and not plan.setting.overlap_comm     # the reference kernels, gloo
    slower = make_plan(cfg, "2xcpu", seq_len=128, gpu_spec=parse_spec(SPEC.replace("cores=4", "cores=2")))
    assert slower.time.parts["GEMMs"] == pytest.approx(2 * plan.time.parts["GEMMs"])
    assert cli.main(["--config", "tiny-cpu", "--gpus", "2xcpu", "--seq-len", "128", "--gpu-spec", SPEC, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["estimate"]["step_total_s"] == pytest.approx(plan.time.total)
    assert set(data["estimate"]["stage_seconds"]) == {"data wait", "forward", "backward", "gradient communication",
                                                      "optimizer"}


@pytest.mark.unit
def test_a_small_step_keeps_the_per_call_floor_and_the_per_tensor_work(monkeypatch):
    """Issue 50: a few tokens' step is mostly per-call work (per layer application, per model, RTD's own) and
    DeepSpeed's per-tensor work; the plan keeps both as the tokens shrink and adds them once per micro-batch."""
    from dataclasses import replace

    from distaff.train.plan import cpu_time
    from distaff.train.plan.gpu_time import Assumptions

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = parse_spec(SPEC)
    plan = make_plan(load_config("tiny-rtd-cpu", ["data.batch_size=1"]), "2xcpu", seq_len=16, gpu_spec=spec)
    s, kind = plan.setting, devices("2xcpu", spec)[1]
    discriminator = s.models[-1]
    floor = sum(sum(cpu_time.fixed_seconds(cfg)) for cfg in s.models) * cpu_time._core_ratio(kind)
    assert floor > 0 and plan.time.parts["fused ops"] >= floor       # the floor, whatever the tokens
    forward_floor = sum(cpu_time.fixed_seconds(cfg)[0] for cfg in s.models) * cpu_time._core_ratio(kind)
    assert plan.time.stages["forward"] > forward_floor
    assert s.param_tensors > 2 * discriminator.num_hidden_layers * 10     # both models' tensors counted
    doubled = replace(s, param_tensors=2 * s.param_tensors)
    per_tensor = cpu_time.optimizer_seconds(doubled, kind, Assumptions()) - cpu_time.optimizer_seconds(s, kind,
                                                                                                       Assumptions())
    table = cpu_time.cpu_table()["deepspeed_per_tensor"][str(min(s.zero, 2))]["step"]
    assert per_tensor == pytest.approx(table * s.param_tensors * 1e-9 * cpu_time._core_ratio(kind))


@pytest.mark.unit
def test_half_precision_attention_reads_its_own_measured_rows_up_to_512_tokens():
    """Issue 50: the attention rows are measured to 512 tokens on fp32 and bf16 inputs (a bf16 call makes float32
    copies of its inputs), and the plan reads the rows of the run's precision, scaled by the probe the rows were
    measured with; at 512 tokens nothing is extrapolated."""
    from distaff.train.model.flops import layer_applications
    from distaff.train.plan import cpu_time

    cfg = load_config("tiny-cpu", ["model.max_position_embeddings=512"]).model_config()
    kind = devices("1xcpu", parse_spec(SPEC))[1]
    rows = [r for r in cpu_time.cpu_table()["attention"] if r["head_dim"] == cfg.head_dim and r["n"] == 512
            and r["span"] == cfg.att_span and r["dropout"] == cfg.attention_probs_dropout_prob]
    measured = {r["precision"]: r["fwd_ms"] + r["bwd_ms"] for r in rows}
    assert set(measured) == {"fp32", "bf16"}
    planned = {p: cpu_time.attention_seconds(cfg, kind, 512, 4096, p).seconds for p in ("fp32", "bf16", "fp16")}
    assert planned["bf16"] / planned["fp32"] == pytest.approx(measured["bf16"] / measured["fp32"])
    assert planned["fp16"] == planned["bf16"]
    per_row = measured["fp32"] / (rows[0]["tokens"] * rows[0]["heads"]) * 1e-3
    ratio = (cpu_time._table_rate(cfg.head_dim, "fp32", "attention_probe")
             / gemm_rate(kind.gemm_curve, cfg.head_dim, "fp32"))
    applications = layer_applications(cfg) if cfg.emd else cfg.num_hidden_layers
    assert planned["fp32"] == pytest.approx(per_row * ratio * 4096 * cfg.num_attention_heads * applications)


@pytest.mark.unit
def test_the_ops_around_the_gemms_cost_the_same_per_token_beyond_the_longest_measured_layer():
    """Issue 50: LayerNorms, GELU, dropout and residuals are per-token work: past the table's longest layer row the
    plan keeps that row's cost per token instead of growing it with the sequence (which planned 4 x 512 high)."""
    from distaff.train.plan import cpu_time

    cfg = load_config("tiny-cpu", ["model.max_position_embeddings=512"]).model_config()
    longest = max(r["n"] for r in cpu_time.cpu_table()["layer_rest"])
    assert cpu_time.layer_rest_ns(cfg, 4 * longest) == cpu_time.layer_rest_ns(cfg, longest) > 0
    assert cpu_time.layer_rest_ns(cfg, longest) != cpu_time.layer_rest_ns(cfg, longest // 2)   # read between rows


@pytest.mark.unit
def test_half_precision_runs_read_deepspeeds_bf16_costs_measured_beside_fp32(monkeypatch):
    """Issue 50: bf16 runs DeepSpeed's FP16_UnfusedOptimizer at ZeRO 0 (fp32 master copies, more work per tensor)
    and reduces half the gradient bytes: the plan reads the table's bf16 figures (fp32's times the ratios measured
    side by side), not fp32's."""
    from dataclasses import replace

    from distaff.train.plan import cpu_time
    from distaff.train.plan.gpu_time import Assumptions

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = parse_spec(SPEC)
    plan = make_plan(load_config("tiny-cpu", ["zero.stage=0", "train.precision=bf16"]), "2xcpu", seq_len=64,
                     gpu_spec=spec)
    s, kind = plan.setting, devices("2xcpu", spec)[1]
    table = cpu_time.cpu_table()
    assert table["deepspeed_per_tensor_bf16"]["0"]["step"] > table["deepspeed_per_tensor"]["0"]["step"]
    for precision, section in (("bf16", "_bf16"), ("fp16", "_bf16"), ("fp32", "")):
        setting = replace(s, precision=precision)
        per_parameter = table["deepspeed" + section]["0"]["step"] * s.params * 1e-9 * cpu_time._core_ratio(kind)
        per_tensor = (table["deepspeed_per_tensor" + section]["0"]["step"] * s.param_tensors * 1e-9
                      * cpu_time._core_ratio(kind))
        assert cpu_time.optimizer_seconds(setting, kind, Assumptions()) == pytest.approx(per_parameter + per_tensor)


@pytest.mark.unit
def test_deepspeeds_costs_follow_the_cores_speed_not_the_copy_bandwidth(monkeypatch):
    """Issue 50: remeasured on a machine whose copies ran 2.4x and small GEMMs 1.3x faster, DeepSpeed's costs per
    parameter ran 1.35-1.5x faster (benchmarks/results/cpu_table_drift.json): the plan's reduction and step scale with
    the probed GEMM rate, and a machine with twice the copy bandwidth gets the same engine step."""
    from distaff.train.plan import cpu_time
    from distaff.train.plan.gpu_time import Assumptions

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cfg = load_config("tiny-cpu", ["zero.stage=2"])

    def engine_seconds(spec: str) -> tuple[float, float]:
        plan = make_plan(cfg, "2xcpu", seq_len=128, gpu_spec=parse_spec(spec))
        kind = devices("2xcpu", parse_spec(spec))[1]
        reduction = cpu_time.communication_seconds(plan.setting, kind, 1, 1, 0.0, 0.0, Assumptions())
        return cpu_time.optimizer_seconds(plan.setting, kind, Assumptions()), reduction["gradient communication"]

    drift = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results"
                        / "cpu_table_drift.json").read_text())
    moved = [ratio for costs in drift["deepspeed"].values() for ratio in costs.values()]
    assert all(abs(ratio / drift["core"] - 1) < abs(ratio / drift["copy"] - 1) for ratio in moved)
    base = engine_seconds(SPEC)
    assert engine_seconds(SPEC.replace("hbm_tb_s=0.01", "hbm_tb_s=0.02")) == pytest.approx(base)
    halved = engine_seconds(SPEC.replace("tflops=0.2,fp32_tflops=0.08", "tflops=0.1,fp32_tflops=0.04"))
    assert halved == pytest.approx((2 * base[0], 2 * base[1]), rel=1e-6)


@pytest.mark.unit
def test_rtds_draw_of_replacements_is_forward_work_per_labelled_logit(monkeypatch):
    """Issue 50: the RTD generator draws a replacement for every labelled token (its logits again, Gumbel noise from
    ``exponential_``, an argmax), measured per logit (``rtd_sampling``); the plan puts it all in the forward, less
    what the per-call figure already holds of it."""
    from distaff.train.plan import cpu_time
    from distaff.train.plan.gpu_time import Assumptions

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    spec = parse_spec(SPEC)
    kind = devices("2xcpu", spec)[1]
    table = cpu_time.cpu_table()["rtd_sampling"]
    assert table["bf16_ns_per_logit"] > cpu_time.cpu_table()["elementwise_ns"]["bf16"]["mlm_loss_per_logit"]
    s = make_plan(load_config("tiny-rtd-cpu", ["zero.stage=0"]), "2xcpu", seq_len=64, gpu_spec=spec).setting
    draw = (s.tokens * s.labelled_share * s.models[0].vocab_size * table["fp32_ns_per_logit"] * 1e-9
            * cpu_time._core_ratio(kind, "rtd_sampling_probe"))
    assert cpu_time.sampling_seconds(s, kind) == pytest.approx(draw)
    with_draw = cpu_time.compute_seconds(s, kind, Assumptions())
    # the per-call figure's pair drew for its labelled half of a few tokens: taken out of it, counted once
    counted = cpu_time.sampling_seconds(s, kind, cpu_time._fixed(s.models[-1])["tokens"] / 2 * table["vocab"])
    monkeypatch.setattr(cpu_time, "sampling_seconds", lambda *args, **kwargs: 0.0)
    without = cpu_time.compute_seconds(s, kind, Assumptions())
    assert with_draw.forward - without.forward == pytest.approx(draw - counted)
    assert sum(with_draw.parts.values()) - sum(without.parts.values()) == pytest.approx(draw - counted)
    assert 0 < counted < draw
