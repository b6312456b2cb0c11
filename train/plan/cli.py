"""``distaff plan --config RUN.yaml --gpus 8xA100-80GB [--nodes N] [--micro-batch B] [--zero S] [--offload]``.

Prints, per GPU: the model states, the activations of one micro-batch by part, the transients and the
allocator margin, whether it fits, the largest micro-batch that fits and each ZeRO stage's total; then the
step time by part, tokens/s, MFU and the time and GPU-hours to ``train.max_steps``: every time an ESTIMATE,
its assumptions printed. ``--json`` writes the same as one JSON object; ``--list-gpus`` the kinds;
``--anchors`` the published measurements the time model is checked against; ``--compare RUN_DIR`` a run's
measured stage times beside its plan. ``--gpus 2xcpu`` plans CPU ranks of this machine (train/plan/cpu.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from distaff.train.core.errors import (MAX_COUNT, MAX_NODES, ConfigError, command_main, document_ranges, float_arg,
                                       int_arg)
from distaff.train.data.manifest import MAX_SEQ_LEN, MIN_SEQ_LEN
from distaff.train.plan import gpus as gpu_kinds
from distaff.train.plan.memory import GIB
from distaff.train.plan.planner import Plan, make_plan, parse_tokens, summary
from distaff.train.plan.gpu_time import ATTENTION_KEYS, Assumptions

PROG = "distaff plan"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="run config YAML, or a run preset's name (deberta-v3-base)")
    parser.add_argument("--gpus", help="GPUs per node as COUNTxKIND, e.g. 8xA100-80GB (--list-gpus)")
    parser.add_argument("--nodes", type=int_arg("--nodes", low=1, high=MAX_NODES), default=1)
    parser.add_argument("--micro-batch", type=int_arg("--micro-batch", low=1, high=MAX_COUNT),
                        help="sequences per GPU per micro-step (default: data.batch_size)")
    parser.add_argument("--zero", type=int_arg("--zero", high=3), help="ZeRO stage (default: zero.stage)")
    parser.add_argument("--offload", action="store_true", default=None, help="optimizer states on the host")
    parser.add_argument("--seq-len", type=int_arg("--seq-len", low=MIN_SEQ_LEN, high=MAX_SEQ_LEN),
                        help="tokens per sequence (default: the prepared data's)")
    parser.add_argument("--tokens", help="train on this many tokens (20B, 500M, 2e10): the steps and GPU-hours at the "
                                         "run's global batch, instead of train.max_steps")
    parser.add_argument("--gpu-spec", help="a kind not in the table: name=N,memory_gib=..,tflops=..,hbm_tb_s=..,"
                                           "intra_gb_s=..,inter_gb_s=..[,like=KIND]")
    parser.add_argument("--gemm-efficiency", type=float_arg("--gemm-efficiency", low=0, low_open=True, high=1),
                        default=Assumptions.gemm_efficiency)
    parser.add_argument("--attention", choices=sorted(ATTENTION_KEYS), default=Assumptions.attention,
                        help="whose disentangled attention the step's time charges: distaff's kernels, or Hugging "
                             "Face's eager attention (both the static judge's estimates); the memory stays distaff's")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--explain", action="store_true", help="the same run on every GPU kind: each part's share of "
                                                               "the step and its speed-up over A100-80GB")
    parser.add_argument("--list-gpus", action="store_true", help="print the GPU kinds and exit")
    parser.add_argument("--anchors", action="store_true", help="plan the published measurements, print ratios")
    parser.add_argument("--compare", metavar="RUN_DIR", help="a finished (or running) run's measured stage times "
                                                             "beside its plan, and the stage furthest off")
    parser.add_argument("--reprobe", action="store_true", help="--gpus Nxcpu: measure this machine again (the probe "
                                                               "is cached)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides of the run config")
    return document_ranges(parser)


def _gib(value: float) -> str:
    return f"{value / GIB:8.2f} GiB"


def memory_lines(plan: Plan) -> list[str]:
    s, m = plan.setting, plan.memory
    device = "CPU rank" if plan.gpu.is_cpu else "GPU"
    lines = [f"memory per {device} ({s.params / 1e6:,.1f} M parameters, {s.precision}, ZeRO {s.zero}"
             f"{' + optimizer offload' if s.offload_optimizer else ''}, micro-batch {s.micro_batch} x {s.seq_len}, "
             f"{s.ranks} ranks; the step's buffers are alive at some of its moments, not all at once):"]
    lines += [f"  {name:<36} {_gib(value)}" for name, value in m.items.items() if value]
    lines += [f"  host memory (offload): {name:<21} {_gib(value)}" for name, value in m.host.items()]
    lines += [f"  peak at the {max(m.phases, key=m.phases.get):<28} {_gib(m.peak)}",
              f"  allocator margin ({'5%' if plan.gpu.is_cpu else '5% + 1 GiB context'})"
              f"{' ' * (19 if plan.gpu.is_cpu else 2)}{_gib(m.margin)}",
              f"  total {_gib(m.total)} of {plan.gpu.memory_gib:.1f} GiB: {'fits' if plan.fits else 'DOES NOT FIT'}",
              *([f"  {plan.kept_scores_advice()}"] if plan.kept_scores_advice() else []),
              f"  largest micro-batch that fits: {plan.largest_micro_batch}",
              "  ZeRO stages at this micro-batch: " + ", ".join(
                  f"{stage}: {total / GIB:.1f} GiB {'fits' if total <= plan.gpu.memory_bytes else 'no'}"
                  for stage, total in plan.zero_fits.items())]
    return lines


def time_lines(plan: Plan) -> list[str]:
    t = plan.time
    lines = [f"step time (ESTIMATE; {plan.grad_accum} micro-batches per step, {plan.nodes} node(s) of "
             f"{plan.per_node} x {plan.gpu.name}{cpu_note(plan)}):"]
    lines += [f"  {name:<32} {seconds * 1e3:10.1f} ms" for name, seconds in t.parts.items()]
    lines += [f"  {'total':<32} {t.total * 1e3:10.1f} ms", f"  {attention_share_line(t)}",
              f"  tokens/s (all ranks)  {plan.tokens_per_s:,.0f}   MFU {plan.mfu:.1%}   "
              f"to {plan.max_steps:,} steps: {plan.hours:,.1f} h, {plan.gpu_hours:,.0f} GPU-hours (estimates)",
              f"  {plan.batch_line()}",
              "assumptions:", f"  sequence length {plan.setting.seq_len} from {plan.seq_source}",
              f"  batches {plan.tokens_line()}",
              f"  attention: {t.attention_source}"]
    return lines + [f"  {line}" for line in plan.assumptions.lines(plan.gpu.is_cpu, plan.setting.zero)]


def cpu_note(plan: Plan) -> str:
    if not plan.gpu.is_cpu:
        return ""
    return f", {plan.gpu.threads} thread(s) per rank of {plan.gpu.cores} cores: the probe's rates, or --gpu-spec"


def attention_share_line(t) -> str:
    """Attention's share of the step, and beside it the share the judge's content-only reference (FlashAttention-2
    at the same shapes) would take, when the attention table has it."""
    line = f"attention: {t.attention_share:.0%} of the step"
    if t.reference_share is not None:
        line += (f"; a content-only FlashAttention-2 at the same shapes (the judge's reference): "
                 f"{t.attention_reference * 1e3:,.1f} ms, {t.reference_share:.0%} of such a step")
    return line


EXPLAIN_BASE = "A100-80GB"     # the kind every other kind's speed-up is read against


def explained(plans: dict[str, Plan]) -> dict[str, dict]:
    """Per GPU kind: the step's seconds by part, each part's share of the step, and each part's speed-up over
    :data:`EXPLAIN_BASE` (where a step's speed-up between two kinds comes from)."""
    base = plans[EXPLAIN_BASE].time
    found = {}
    for name, plan in plans.items():
        parts = plan.time.parts
        speedup = {part: base.parts[part] / seconds for part, seconds in parts.items() if seconds > 0}
        found[name] = {"step_s": plan.time.total, "parts_s": parts, "shares": plan.time.shares,
                       f"speedup_vs_{EXPLAIN_BASE}": {"step": base.total / plan.time.total, **speedup}}
    return found


def explain_lines(plans: dict[str, Plan]) -> list[str]:
    table = explained(plans)
    parts = list(next(iter(plans.values())).time.parts)
    key = f"speedup_vs_{EXPLAIN_BASE}"
    lines = [f"the same run on each GPU kind (ESTIMATES): each part's ms and share of the step, and its speed-up over "
             f"{EXPLAIN_BASE}", "", f"| kind | step ms | {' | '.join(parts)} | speed-up over {EXPLAIN_BASE}: step; "
             f"{', '.join(parts[:3])} |", "|---" * (len(parts) + 3) + "|"]
    for name, row in table.items():
        cells = [f"{row['parts_s'][p] * 1e3:,.1f} ({row['shares'][p]:.0%})" for p in parts]
        ups = ", ".join(f"{row[key].get(p, 0):.2f}x" for p in parts[:3])
        lines.append(f"| {name} | {row['step_s'] * 1e3:,.1f} | {' | '.join(cells)} | {row[key]['step']:.2f}x; {ups} |")
    return lines + ["", "GEMMs scale with the dense tensor peak, fused ops and the optimizer with HBM bandwidth, "
                        "communication with the links; attention is the judge's estimate of distaff's kernels for each "
                        "architecture (train/plan/attention_table.json: sm_80 for A100, sm_90 for H100/H200), so a "
                        "speed-up of attention beyond the peak ratio is the judge's reading of distaff's own kernels on "
                        "that architecture, not a published measurement"]


def as_json(plan: Plan) -> dict:
    s = plan.setting
    return {"gpu": asdict(plan.gpu), "gpus_per_node": plan.per_node, "nodes": plan.nodes,
            "params": s.params, "precision": s.precision, "zero": s.zero, "offload_optimizer": s.offload_optimizer,
            "micro_batch": s.micro_batch, "seq_len": s.seq_len, "seq_len_source": plan.seq_source,
            "packing": "varlen" if s.packed else "padded", "tokens_per_micro_batch": s.tokens,
            "mean_sample_tokens": s.mean_sample, "sample_length_source": plan.sample_source,
            "real_tokens_per_micro_batch": s.real_tokens,
            "memory_bytes": {**plan.memory.items, "peak": plan.memory.peak, "margin": plan.memory.margin,
                             "total": plan.memory.total}, "phases_bytes": plan.memory.phases,
            "fits": plan.fits, "largest_micro_batch": plan.largest_micro_batch,
            "zero_stage_total_bytes": {str(k): v for k, v in plan.zero_fits.items()},
            "estimate": {"step_seconds": plan.time.parts, "step_total_s": plan.time.total,
                         "tokens_per_s": plan.tokens_per_s, "mfu": plan.mfu, "hours": plan.hours,
                         "gpu_hours": plan.gpu_hours, "attention_source": plan.time.attention_source,
                         "stage_seconds": plan.time.stages, "attention_share": plan.time.attention_share,
                         "content_only_attention_s": plan.time.attention_reference,
                         "content_only_attention_share": plan.time.reference_share},
            "max_steps": plan.max_steps, "token_budget": plan.token_budget, "global_batch": plan.global_batch,
            "tokens_per_step": plan.tokens_per_step,
            "assumptions": plan.assumptions.lines(plan.gpu.is_cpu, plan.setting.zero), "summary": summary(plan)}


def _run_config(path: str, overrides: list[str]):
    """The run config; a plan needs its model, not its data (an unset ``data.dir`` is allowed)."""
    from distaff.train.run.config import config_from_dict, read_config_values

    values = read_config_values(path, overrides)
    if not (values.get("model") or {}).get("preset") and not (values.get("model") or {}).get("init_from"):
        raise ConfigError(f"{path}: no model (model.preset or model.init_from); set one, e.g. "
                          "model.preset=deberta-v3-base")
    data = values.setdefault("data", {}) if isinstance(values.get("data", {}), dict) else values["data"]
    if isinstance(data, dict):
        data.setdefault("dir", "(not prepared yet)")
    return config_from_dict(values)


def _body(argv: list[str]) -> int:
    args = _parser().parse_intermixed_args(argv)       # options may follow the overrides, as in launch
    if args.list_gpus:
        print("\n".join(gpu_kinds.table_rows()))
        return 0
    if args.anchors:
        from distaff.train.plan.anchors import anchor_lines

        print("\n".join(anchor_lines()))
        return 0
    if args.compare:
        from distaff.train.plan.compare import compare_lines

        print("\n".join(compare_lines(Path(args.compare))))
        return 0
    if args.reprobe:
        from distaff.train.plan.cpu import probed

        probed(refresh=True)
    if not args.config or not args.gpus:
        raise ConfigError("--config and --gpus are required (e.g. --config deberta-v3-base --gpus 8xA100-80GB)")
    cfg = _run_config(args.config, args.overrides)
    spec = gpu_kinds.parse_spec(args.gpu_spec) if args.gpu_spec else None
    def plan_on(gpus: str) -> Plan:
        return make_plan(cfg, gpus, args.nodes, micro_batch=args.micro_batch, zero=args.zero, offload=args.offload,
                         seq_len=args.seq_len, gpu_spec=spec,
                         assumptions=Assumptions(gemm_efficiency=args.gemm_efficiency, attention=args.attention),
                         tokens=parse_tokens(args.tokens) if args.tokens else None)

    plan = plan_on(args.gpus)
    if args.micro_batch is not None and not plan.fits:
        raise ConfigError(f"--micro-batch {args.micro_batch}: needs {plan.memory.total / GIB:.1f} GiB per GPU, "
                          f"more than the {plan.gpu.memory_gib:.1f} GiB of a {plan.gpu.name}; the largest that fits "
                          f"is {plan.largest_micro_batch}" + ("" if plan.largest_micro_batch else
                                                               "; try --zero 3, --offload or more GPUs"))
    per_node = gpu_kinds.split_gpus(args.gpus)[0]
    kinds = {name: plan_on(f"{per_node}x{name}") for name in gpu_kinds.KINDS} if args.explain else {}
    if args.json:
        print(json.dumps({**as_json(plan), **({"explain": explained(kinds)} if kinds else {})}, indent=1))
    else:
        print("\n".join([summary(plan), "", *memory_lines(plan), "", *time_lines(plan),
                         *(["", *explain_lines(kinds)] if kinds else [])]))
    return 0


def main(argv: list[str] | None = None) -> int:
    return command_main(PROG, _body, argv)


if __name__ == "__main__":
    sys.exit(main())
