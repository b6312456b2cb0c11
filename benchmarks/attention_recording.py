"""What the static attention judge (``attention_judge.py``) estimates: each implementation's forward and
backward recorded on fake tensors, nothing run. Triton launches are recorded instead of run; every other torch
operation on the implementation's tensors is recorded by a dispatch mode with its FLOPs and bytes, as GPU work;
host planning on real CPU tensors is not. The implementations: distaff's public op, DisentangledFlash 1.1.1 and
FlashDeBERTa 0.0.8 (a benchmark extra), a content-only FlashAttention-2 in the Triton tutorial's design
(``attention_anchor``) and Hugging Face ``transformers``' eager DeBERTa-v2 attention."""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attention_anchor  # noqa: E402  (a sibling script, not a package)

from distaff.kernels import attention as distaff_attention
from distaff.kernels.aot import static_perf
from distaff.kernels.relative_position import attention_span

HEADS, BUCKETS, MAX_REL = 12, 256, 512
PASSES = ("fwd", "bwd")


class Unavailable(Exception):
    """A row that cannot be produced here (peer not installed, option it does not have)."""


# --------------------------------------------------------------------------- recording


@dataclass
class OpCost:
    name: str
    flops: float
    bytes: float

    def seconds(self, gpu: static_perf.Gpu, gemm_efficiency: float = 1.0) -> float:
        return max(self.flops / (gpu.tensor_tflops * 1e12 * gemm_efficiency), self.bytes / (gpu.hbm_tb_s * 1e12))


@dataclass
class Recording:
    """One pass (forward or backward) of one implementation: its kernel launches, its other work and its
    host reads of device values."""

    pass_: str
    launches: list = field(default_factory=list)   # (kernel, args, kwargs, grid)
    outside: list = field(default_factory=list)    # OpCost
    sync_ops: list = field(default_factory=list)   # one name per device-to-host read
    gemm_efficiency: float = 1.0                   # of the dense peak its torch GEMMs run at (1: the roofline)

    @property
    def syncs(self) -> int:
        return len(self.sync_ops)

    def outside_seconds(self, gpu: static_perf.Gpu) -> float:
        return sum(op.seconds(gpu, self.gemm_efficiency) for op in self.outside)


_VIEWS = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze",
          "select", "slice", "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "lift_fresh",
          "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "device", "sym_size",
          "sym_stride", "sym_numel", "dim", "is_contiguous"}
_SYNCS = {"_local_scalar_dense", "equal", "is_nonzero"}
_GEMMS = {"mm", "bmm", "addmm", "baddbmm", "addbmm"}
_OVERWRITES = {"zero_", "fill_", "copy_", "uniform_", "normal_", "bernoulli_", "random_"}


def _nbytes(value) -> float:
    """Bytes a tensor (or nested list of them) occupies: a broadcast view (``expand``: stride 0) is read from
    its storage once, not once per repeated element."""
    if isinstance(value, torch.Tensor):
        return min(value.numel() * value.element_size(), value.untyped_storage().nbytes())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0.0


def _on_device(values) -> bool:
    """Whether any tensor among ``values`` (nested in lists/tuples) stands for a GPU tensor: one on a (fake)
    GPU (the peers' inputs), or any fake tensor (distaff's inputs are fake CPU tensors, whose host code then
    plans for the judged GPU). Real CPU tensors are host work: the tables planned once per shape, the
    dropout seed drawn from the CPU generator."""
    from torch._subclasses.fake_tensor import is_fake

    for v in values:
        if isinstance(v, torch.Tensor) and (v.device.type != "cpu" or is_fake(v)):
            return True
        if isinstance(v, (list, tuple)) and _on_device(v):
            return True
    return False


class _OutsideWork(TorchDispatchMode):
    """Records the FLOPs (matrix products) and bytes (inputs read, outputs written) of every torch
    operation, views and allocations excluded."""

    def __init__(self, sink: list, syncs: list):
        super().__init__()
        self.sink, self.syncs = sink, syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not _on_device([*args, *(kwargs or {}).values(), out]):
            return out  # host work on CPU tensors (tables computed once per shape): no GPU time, no sync
        if name in _SYNCS:  # .item(), int(t), .tolist(): the host waits for the device
            self.syncs.append(name)
            return out
        if name in _VIEWS:
            return out
        flops = 0.0
        gemm = name.rstrip("_")  # in place or not
        if gemm in _GEMMS:
            a, b = (args[1], args[2]) if gemm in ("addmm", "baddbmm", "addbmm") else (args[0], args[1])
            flops = 2.0 * a.numel() * b.shape[-1]
        # Reads its inputs, writes its output: an in-place op (``add_``) reads and writes its first argument;
        # one that only overwrites it (``zero_``, ``copy_``'s destination) does not read it.
        read = _nbytes(list(args[1:] if name in _OVERWRITES else args))
        self.sink.append(OpCost(name, flops, read + _nbytes(out)))
        return out


@contextlib.contextmanager
def _recording(sink: Recording):
    """Record Triton launches (nothing runs) and the torch work around them into ``sink``."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        grid = grid(kwargs) if callable(grid) else grid
        sink.launches.append((self, args, kwargs, tuple(grid) + (1,) * (3 - len(grid))))

    JITFunction.run = record
    try:
        with _OutsideWork(sink.outside, sink.sync_ops):
            yield
    finally:
        JITFunction.run = original


@dataclass(frozen=True)
class Workload:
    n: int
    batch: int
    head_dim: int
    dropout: float
    cc: int

    @property
    def name(self) -> str:
        return f"N={self.n} B={self.batch} d={self.head_dim} p={self.dropout:g}"


def record_distaff(w: Workload, keep_scores: bool = True) -> dict:
    """distaff's public op planned for ``w.cc``, on fake tensors (``keep_scores``: the op's, by default the
    forward's dense position scores kept for the backward, as the model's ``keep_position_scores`` default has
    it): every torch operation on them (the mask's cast, the end terms' and the partials' zero-fills, the
    partials' sums and casts) is charged as GPU work,
    as the peers' are, its GEMMs (the dense backward's position products) at ``CUBLAS_EFFICIENCY`` as Hugging
    Face eager's; the host's planning runs on real CPU tensors, once per shape, and is not. Q, K, V and the
    output's gradient come in the model's layout (:func:`_model_heads`), the peers' in their APIs' own
    contiguous ``[B, H, N, d]``: each is charged what it does with what it is handed in training."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    span = attention_span(BUCKETS, MAX_REL)
    passes = {p: Recording(p, gemm_efficiency=CUBLAS_EFFICIENCY.get(w.cc, 0.75)) for p in PASSES}
    planned = distaff_attention.planning.PLANNED_CAPABILITY
    distaff_attention.planning.PLANNED_CAPABILITY = w.cc
    try:
        with FakeTensorMode():
            q, k, v = (_model_heads(w).requires_grad_() for _ in range(3))
            kr, qr = (torch.empty(HEADS, 2 * span, w.head_dim, dtype=torch.bfloat16).requires_grad_()
                      for _ in range(2))
            mask = torch.ones(w.batch, w.n)
            grad = _model_heads(w)
            with _recording(passes["fwd"]):
                out = distaff_attention.disentangled_attention(q, k, v, kr, qr, attention_mask=mask,
                                                               position_buckets=BUCKETS,
                                                               max_relative_positions=MAX_REL, dropout_p=w.dropout,
                                                               keep_scores=keep_scores)
            with _recording(passes["bwd"]):
                torch.autograd.grad(out, (q, k, v, kr, qr), grad)  # no AccumulateGrad copies: the op's own work
    finally:
        distaff_attention.planning.PLANNED_CAPABILITY = planned
    return passes


def _model_heads(w: Workload) -> torch.Tensor:
    """``[B, H, N, d]`` as distaff's model hands it to the op (``train/model/deberta.py``, ``_heads``): a view of
    a ``[B, N, H * d]`` projection, each token's heads side by side; the output's gradient arrives in the same
    layout (the model's ``transpose(1, 2).flatten(2)``)."""
    projection = torch.empty(w.batch, w.n, HEADS * w.head_dim, dtype=torch.bfloat16)
    return projection.unflatten(-1, (HEADS, -1)).transpose(1, 2)


def _fake_like(fake_mode, tensor: torch.Tensor) -> torch.Tensor:
    """A fake CUDA tensor of ``tensor``'s shape and dtype (what the peers' host code reads of it)."""
    with fake_mode:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cuda")


class _Ctx:
    """The autograd context the peers' ``backward`` reads, for calling their passes one at a time."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _fake_gpu(cc: int):
    """The fake-tensor mode the peers run in, on a fake CUDA device of capability ``cc``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if cc not in static_perf.GPUS:
        raise Unavailable(f"no GPU model for sm_{cc}")
    return FakeTensorMode(allow_non_fake_inputs=True)


def _basic_index(tensor: torch.Tensor, index) -> torch.Tensor:
    """``tensor[index]`` for basic indices (ints, slices, None) through view ops: a CPU build of torch
    cannot run Python indexing on fake CUDA tensors (it opens a CUDA device guard)."""
    dim = 0
    for item in index if isinstance(index, tuple) else (index,):
        if item is None:
            tensor = tensor.unsqueeze(dim)
            dim += 1
        elif isinstance(item, int):
            tensor = tensor.select(dim, item)
        elif isinstance(item, slice) and item.step in (None, 1):
            start, stop, _ = item.indices(tensor.shape[dim])
            tensor = tensor.narrow(dim, start, max(0, stop - start))
            dim += 1
        else:
            raise Unavailable(f"index {index!r} on a fake CUDA tensor")
    return tensor


@contextlib.contextmanager
def _indexable_fake_tensors():
    """Route basic indexing of fake tensors through :func:`_basic_index` while the peers run."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch.Tensor.__getitem__

    def getitem(self, index):
        return _basic_index(self, index) if isinstance(self, FakeTensor) else original(self, index)

    torch.Tensor.__getitem__ = getitem
    try:
        yield
    finally:
        torch.Tensor.__getitem__ = original


def record_disentangled_flash(w: Workload, heads: int = HEADS, configs: tuple | None = None) -> dict:
    """DisentangledFlash's training attention over ``[w.batch, heads, w.n, d]``, forward and backward: with
    the launch configuration its layer resolves with its built-in heuristic (as its README's benchmark), or
    with ``configs`` (forward, dq, dk/dv ``(block_m, block_n, warps, stages)``: what its tuning profile ran)."""
    try:
        import disentangled_flash.training._kernels as kernels
        from disentangled_flash import KernelConfig, KernelTuningOptions, TritonTrainingDisentangledSelfAttention
        from disentangled_flash.position import SharedPositionPlanCache, aligned_slot_count
        from transformers import DebertaV2Config
    except ImportError as error:
        raise Unavailable(f"not installed ({error.name})") from error
    config = DebertaV2Config(hidden_size=heads * w.head_dim, num_attention_heads=heads, position_buckets=BUCKETS,
                             max_relative_positions=MAX_REL, relative_attention=True, pos_att_type=["p2c", "c2p"],
                             share_att_key=True, attention_probs_dropout_prob=w.dropout)
    passes, captured = {p: Recording(p) for p in PASSES}, {}
    with _df_recording(kernels, passes, captured, static_perf.GPUS[w.cc], w.cc):
        fake = _fake_gpu(w.cc)
        layer = _fake_layer(fake, TritonTrainingDisentangledSelfAttention, config,
                            tuning=KernelTuningOptions(mode="heuristic"))
        plan = SharedPositionPlanCache(position_buckets=BUCKETS, max_relative_positions=MAX_REL,
                                       position_embedding_size=BUCKETS).compact(w.n, "cpu")
        band = plan.gradient_band._replace(column_slots=_fake_like(fake, plan.gradient_band.column_slots))
        slots = aligned_slot_count(plan.active_slots.numel())
        with fake, _indexable_fake_tensors():
            q, k, v = (torch.empty(w.batch, heads, w.n, w.head_dim, dtype=torch.bfloat16, device="cuda")
                       for _ in range(3))
            pos_key, pos_query = (torch.empty(heads, slots, w.head_dim, dtype=torch.bfloat16, device="cuda")
                                  for _ in range(2))
            mask = torch.ones(w.batch, w.n, dtype=torch.bool, device="cuda")

            def attention(fwd, dq, dkv):
                return kernels.training_attention(
                    q, k, v, pos_key, pos_query, _fake_like(fake, plan.delta_to_local), mask,
                    score_scale=1.0 / math.sqrt(3 * w.head_dim), has_padding=True, strict_fp32=True,
                    forward_config=fwd, dq_config=dq, dkv_config=dkv, autotune_candidates=layer.tuning.candidates,
                    dropout_p=w.dropout, gradient_band=band)

            if configs:
                attention(*(KernelConfig(*c) for c in configs))
            else:  # what the layer's forward passes (disentangled_flash/training/attention.py, v1.1.1)
                layer._launch_with_profile_fallback(attention, dict(
                    hidden_states=q, sequence_length=w.n, batch_heads=w.batch * heads,
                    active_slots=plan.active_slots.numel(), has_c2p=True, has_p2c=True, layout="padded",
                    uses_padding_mask=True, has_dropout=w.dropout > 0))
            ctx = _Ctx()
            kernels._setup_training_attention_context(ctx, captured["inputs"], captured["output"])
            with _recording(passes["bwd"]):
                kernels._training_attention_autograd_backward(ctx, torch.empty_like(captured["output"][0]), None)
    return passes


@contextlib.contextmanager
def _df_recording(kernels, passes: dict, captured: dict, gpu: static_perf.Gpu, cc: int):
    """DisentangledFlash's two passes are torch.library triton_ops: run their Python bodies (the fake mode
    would run only the ops' shape functions, launching nothing), the forward's launches recorded into
    ``passes["fwd"]``, its inputs and output kept in ``captured``; its tuning sees ``gpu``."""
    from disentangled_flash import tuning

    forward_op, backward_op = kernels._training_attention_forward_op, kernels._training_attention_backward_op

    def forward_recorded(*inputs):
        with _recording(passes["fwd"]):
            captured["output"] = forward_op._init_fn(*inputs)
        captured["inputs"] = inputs
        return captured["output"]

    resources = tuning._device_resources
    tuning._device_resources = lambda index: tuning.DeviceResources(gpu.shared_per_sm - 1024, gpu.sms,
                                                                      (cc // 10, cc % 10))
    kernels._training_attention_forward_op = forward_recorded
    kernels._training_attention_backward_op = backward_op._init_fn
    try:
        yield
    finally:
        kernels._training_attention_forward_op, kernels._training_attention_backward_op = forward_op, backward_op
        tuning._device_resources = resources


def _fake_layer(fake, cls, config, **kwargs):
    """``cls(config, **kwargs)`` with bf16 parameters on the fake CUDA device (no gradients: the passes
    are driven one at a time)."""
    with torch.device("meta"):
        layer = cls(config, **kwargs)
    for module in layer.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                with fake:
                    module._parameters[name] = torch.nn.Parameter(
                        torch.empty(param.shape, dtype=torch.bfloat16, device="cuda"), requires_grad=False)
    return layer


def record_flashdeberta(w: Workload) -> dict:
    """FlashDeBERTa's disentangled attention (its default tiles; it has no attention dropout)."""
    if w.dropout:
        raise Unavailable("no attention dropout")
    try:
        from flashdeberta.ops import flash_attention as fd
        from flashdeberta.ops import position
    except ImportError as error:
        raise Unavailable(f"not installed ({error.name})") from error
    fake = _fake_gpu(w.cc)

    def on_fake_device(build):
        """FlashDeBERTa builds its position plan from values (``tolist``): build it on the CPU, outside the
        fake mode, and hand over fake CUDA copies."""
        def built(*args):
            with _disable_current_modes():
                real = build(*args[:5], torch.device("cpu"), *args[6:])
            if isinstance(real, tuple):
                return type(real)(*(_fake_like(fake, x) if isinstance(x, torch.Tensor) else x for x in real))
            return _fake_like(fake, real)
        return built

    span = attention_span(BUCKETS, MAX_REL)
    passes = {p: Recording(p) for p in PASSES}
    saved = fd.position_plan, fd.fold_matrix, torch.cuda.device
    fd.position_plan = on_fake_device(position.position_plan)
    fd.fold_matrix = on_fake_device(position.fold_matrix)
    torch.cuda.device = lambda index: contextlib.nullcontext()
    try:
        with fake, _indexable_fake_tensors():
            q, k, v = (torch.empty(w.batch, HEADS, w.n, w.head_dim, dtype=torch.bfloat16, device="cuda")
                       for _ in range(3))
            kr, qr = (torch.empty(1, HEADS, 2 * span, w.head_dim, dtype=torch.bfloat16, device="cuda")
                      for _ in range(2))
            ctx = _Ctx()
            scale = 1.0 / math.sqrt(3 * w.head_dim)
            with _recording(passes["fwd"]):
                out = fd.FlashAttentionDisentangled.forward(ctx, q, k, v, None, kr, qr, False, scale, BUCKETS, MAX_REL)
            with _recording(passes["bwd"]):
                fd.FlashAttentionDisentangled.backward(ctx, torch.empty_like(out))
    finally:
        fd.position_plan, fd.fold_matrix, torch.cuda.device = saved
    return passes


def record_content_reference(w: Workload) -> dict:
    """FlashAttention-2 in the Triton tutorial's design (``attention_anchor``) at the workload's shape: plain
    attention, no position terms, no mask and no dropout (at either dropout: what the terms and the options
    cost beyond it is the point). Its launches only: it has no torch work around them."""
    passes = {p: Recording(p) for p in PASSES}
    passes["fwd"].launches.append(attention_anchor.launch(w.n, w.batch, HEADS, w.head_dim))
    passes["bwd"].launches.extend(attention_anchor.backward_launches(w.n, w.batch, HEADS, w.head_dim))
    return passes


# The efficiency cuBLAS reaches on large dense bf16 GEMMs, of the dense peak (a stated model input, not a cited
# measurement: about 80% on an A100, 75% on an H100); HF's attention products are small-K batched GEMMs that
# reach less, so this is favourable to HF. At d = 64 it does not matter: every one of them (K = 64, or an N x N
# operand) has at most 64 FLOPs per byte, under both GPUs' ridge points, and is charged its bytes.
CUBLAS_EFFICIENCY = {80: 0.8, 90: 0.75, 100: 0.75}


def _native_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    """What ``F.dropout`` runs on a CUDA tensor (``at::dropout``): the input itself at p = 0 or in eval,
    else one fused ``native_dropout`` pass (output and a bool mask); on the judge's fake CPU tensors torch
    would take its CPU composition (bernoulli, divide, multiply: three passes), which no GPU runs."""
    return x if p == 0 or not training else torch.native_dropout(x, p, True)[0]


def record_hf_eager(w: Workload) -> dict:
    """Hugging Face ``transformers``' DeBERTa-v2/v3 attention (``DisentangledSelfAttention``) as it runs in
    training, on fake tensors, its Q/K/V projections left out (identity) as every other column leaves them
    out: the scaled Q K^T, the c2p and p2c products with the position rows repeated per sequence, their
    gathers over the N x N relative positions, the mask's cast and fill, softmax, attention dropout, the
    value product and the layout copies, then autograd's backward of all of it; each torch op one launch,
    GEMMs at ``CUBLAS_EFFICIENCY``, every other pass at the HBM roofline. The relative positions and the
    [B, 1, N, N] mask (int64, as the encoder builds them from a tokenizer's mask) are built once per model
    forward by the encoder and not charged; what each layer does with them is. bf16 throughout (the layer in
    bf16; under autocast softmax would run in float32 and move more bytes: this is HF's cheaper way)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        from transformers import DebertaV2Config
        from transformers.models.deberta_v2 import modeling_deberta_v2 as hf
    except ImportError as error:
        raise Unavailable(f"not installed ({error.name})") from error
    config = DebertaV2Config(hidden_size=HEADS * w.head_dim, num_attention_heads=HEADS, position_buckets=BUCKETS,
                             max_relative_positions=MAX_REL, relative_attention=True, pos_att_type=["p2c", "c2p"],
                             share_att_key=True, attention_probs_dropout_prob=w.dropout, hidden_dropout_prob=w.dropout)
    with torch.device("meta"):
        layer = hf.DisentangledSelfAttention(config).train()
    layer.query_proj = layer.key_proj = layer.value_proj = torch.nn.Identity()
    passes = {p: Recording(p, gemm_efficiency=CUBLAS_EFFICIENCY.get(w.cc, 0.75)) for p in PASSES}
    saved = torch.nn.functional.dropout, hf.scaled_size_sqrt
    torch.nn.functional.dropout = _native_dropout
    hf.scaled_size_sqrt = _host_scalar(hf.scaled_size_sqrt)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            hidden = torch.empty(w.batch, w.n, HEADS * w.head_dim, dtype=torch.bfloat16).requires_grad_()
            rel = torch.empty(2 * BUCKETS, HEADS * w.head_dim, dtype=torch.bfloat16).requires_grad_()
            mask = torch.empty(w.batch, 1, w.n, w.n, dtype=torch.int64)
            relative_pos = torch.empty(1, w.n, w.n, dtype=torch.int64)
            with _recording(passes["fwd"]):
                out, _ = layer(hidden, mask, relative_pos=relative_pos, rel_embeddings=rel)
            with _recording(passes["bwd"]):
                torch.autograd.grad(out, (hidden, rel), torch.empty_like(out))
    finally:
        torch.nn.functional.dropout, hf.scaled_size_sqrt = saved
    return passes


def _host_scalar(build):
    """``build`` run outside the fake mode: HF's score scale is a CPU tensor (``torch.tensor(d)``, no device)
    computed and cast (to the layer's dtype, as HF's ``scale.to(dtype=...)`` does next: then a no-op) on the
    host, which the fake mode would otherwise turn into device launches."""
    def on_host(layer, *args):
        with _disable_current_modes():
            return build(layer, *args).to(layer.dtype)
    return on_host


CONTENT = "FlashAttention-2 (content only)"
HF_EAGER = "HF eager"
RECOMPUTED = "distaff, scores recomputed"  # model.keep_position_scores=false: the memory-saving setting
IMPLEMENTATIONS = {"distaff": record_distaff, RECOMPUTED: functools.partial(record_distaff, keep_scores=False),
                   "DisentangledFlash": record_disentangled_flash,
                   "FlashDeBERTa": record_flashdeberta, CONTENT: record_content_reference, HF_EAGER: record_hf_eager}
