"""Bytes per rank of one training step, as DeepSpeed 0.19.8 allocates them for the engine distaff builds.

``train/run/engine.py`` gives DeepSpeed a torch AdamW (fused on GPUs, foreach on CPUs), ZeRO >= 1 with
``contiguous_gradients`` and ``reduce_scatter`` on and ``overlap_comm`` on GPUs only, and no
``grad_accum_dtype`` (so gradients are accumulated in the model's precision). From DeepSpeed's code
(``deepspeed/runtime/...``, lines of 0.19.8), per rank, ``P`` parameters over ``W`` ranks, ``S = P / W``,
``a`` bytes per weight (4 fp32, 2 bf16/fp16), ``L`` the largest parameter (the tied word table):

- ZeRO 0, fp32: the torch optimizer itself (engine.py:2365): weights, gradients, two fp32 moments;
- ZeRO 0, bf16/fp16: ``FP16_UnfusedOptimizer`` (engine.py:2321 picks it for a non-fused optimizer at
  engine.py:2599): fp32 master copies of every weight (fp16/unfused_optimizer.py:78), fp32 moments, and at
  the step an fp32 copy of every gradient (unfused_optimizer.py:222) beside the half-precision ones;
- ZeRO 0 all-reduces the gradients through one flat copy (engine.py:3796, ``allreduce_bucket``'s flatten);
- ZeRO 1-2: ``DeepSpeedZeroOptimizer``: the weights flattened into one buffer per group
  (zero/stage_1_and_2.py:505), an fp32 master partition cloned even in fp32 (stage_1_and_2.py:560), fp32
  moments of the partition; with ``contiguous_gradients`` the first gradient hook allocates the reduce
  bucket, ``reduce_bucket_size`` = 5e8 elements whatever the model's size, a second one with
  ``overlap_comm`` (stage_1_and_2.py:3266, 3275): ZeRO 1 too, and it lives until the backward's epilogue
  (stage_1_and_2.py:1061); the reduction flattens the bucket's gradient slices once more (``allreduce_bucket``,
  stage_1_and_2.py:2367), the rank's partition is copied out (stage_1_and_2.py:2192), the step casts it to
  fp32 (stage_1_and_2.py:3118) and takes its norm in float64 one gradient at a time (stage_1_and_2.py:2684);
  the new weights are all-gathered into a fresh buffer (gloo and NCCL's ``all_gather_into_tensor``);
- ZeRO 3: ``DeepSpeedZeroOptimizer_Stage3``: the weights' partitions, except parameters of at most
  ``stage3_param_persistence_threshold`` = 1e5 elements, kept whole on every rank (zero/partition_parameters.py
  :1292); an fp32 master partition (stage3.py:1172; a copy in fp32 too);
  one reduce bucket allocated at start and kept (stage3.py:782, whatever ``overlap_comm``); the gradient
  partitions in one flat buffer, kept (stage3.py:791); a module's weights are gathered whole for its forward
  and backward, so never less than the largest parameter (the word table, gathered for the embedding and
  again for the tied decoder) is gathered, and with the default reuse distance every weight stays gathered
  from its forward to its backward (:func:`gathered_weights`); the reduction flattens the gradients and
  reduce-scatters a copy (stage3.py:1912);
- optimizer offload: the master partition, its fp32 gradient and the moments live on the host; the GPU keeps
  a buffer of the largest parameter's size for the copies (stage_1_and_2.py:659).

Activations (what autograd keeps from the forward for the backward), per layer application, for ``T`` tokens
of hidden ``D``, feed-forward ``I``, ``H`` heads: the layer input, Q/K/V, the attention output and its
``[B, N, D]`` relayout, the attention's float32 log-sum-exp, two LayerNorm inputs with float32 mean and
1/std, the feed-forward input, the pre-GELU and post-GELU ``[T, I]`` tensors, the dropout masks (one byte per
element) and the per-layer position tables ``Kr``/``Qr``; the fused attention with ``keep_position_scores`` its
dense position scores, ``H x T x 2k`` per term (counted apart, :func:`kept_scores`). The PyTorch reference path
(the CPU) adds the relative-position index, keeps the attention output in the heads' layout (no relayout copy),
computes half-precision attention in float32 (its Q/K/V/output copies are float32) and keeps each dropout's mask
in the activations' dtype (torch's CPU dropout multiplies by a noise tensor of the input's dtype; only its CUDA
kernel makes a one-byte mask). The MLM head keeps the labelled rows (15 %) and, fused, the float32 gradient of
the ``V x E`` decoder computed in the forward; the reference keeps the float32 log-softmax of ``[M, V]``.

A step's peak is the largest of five moments: the end of the forward (activations, the head's logits), the
start of the backward (activations, ZeRO 1-2's bucket(s)), the word table's backward (the decoder's and the
lookup's gradients of the tied table and their sum, alive together), the reduction at the end of the backward
(its flat copies) and the optimizer step (the fp32 gradients and the optimizer's temporaries). On the reference
path the backward starts with the loss's two ``[M, V]`` float32 gradients beside the kept log-softmax, before the
decoder's ``V x E`` gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distaff.train.model.config import ModelConfig
from distaff.train.model.flops import layer_applications
from distaff.train.model.param_count import mlm_parameter_sizes, rtd_parameter_sizes

REDUCE_BUCKET = 500_000_000         # zero_optimization.reduce_bucket_size default (zero/config.py), elements
PERSISTENCE = 100_000              # stage3_param_persistence_threshold default (zero/config.py:228), elements
MAX_LIVE = 1_000_000_000           # stage3_max_live_parameters default (zero/config.py:245), elements
LABELLED = 0.15                     # masked fraction of the collator's default
LOGITS_CHUNK = 1 << 24              # the fused MLM loss's logits chunk (kernels/mlm_loss.py LOGITS_CHUNK_ELEMENTS)
GIB = 1024 ** 3
HEAD_BACKWARD = "MLM loss gradients (transient)"
DENSE_SCORES = "dense attention scores (transient)"
KEPT_SCORES = "attention's kept position scores"   # model.keep_position_scores (kept_scores)
# items that make up "model states" as DeepSpeed's estimators count them (weights, gradients, optimizer states)
MODEL_STATE_ITEMS = ("weights", "gradients", "fp32 master weights", "Adam moments", "fp32 gradients (step)",
                     "gathered weights and their gradient")


@dataclass(frozen=True)
class Setting:
    """What the memory model reads of a run: the model(s), the micro-batch, precision, ZeRO, the ranks."""

    models: tuple[ModelConfig, ...]  # the MLM model, or (generator, discriminator) for RTD
    params: int                      # trainable parameters of everything the engine holds
    seq_len: int
    micro_batch: int
    precision: str                   # fp32 | bf16 | fp16
    zero: int
    ranks: int                       # data-parallel ranks (all GPUs)
    offload_optimizer: bool = False
    offload_param: bool = False
    fused: bool = True               # the GPU path (Triton kernels, fused AdamW) or the CPU's (PyTorch reference)
    overlap_comm: bool = True        # DeepSpeed's ZeRO setting: True on GPUs (train/run/engine.py)
    dropout: bool = True
    labelled: float = LABELLED       # fraction of tokens the MLM head reads (T-TA: all)
    largest_param: int = 0           # elements of the largest parameter (the word table)
    persistent_params: int = 0       # elements of parameters ZeRO 3 keeps whole on every rank
    param_tensors: int = 0           # parameter tensors of everything the engine holds
    packed: bool = False             # data.packing=varlen: whole samples end to end, attention per sample
    token_budget: int = 0            # packed: tokens per micro-batch (data.tokens_per_batch); 0: micro_batch x seq_len
    sample_len: float = 0.0          # real tokens per sample on average (the manifest's); 0: full sequences

    @property
    def tokens(self) -> int:
        """Positions one micro-batch computes: padded, micro_batch x seq_len (padding included); packed, the budget."""
        return self.token_budget if self.packed and self.token_budget else self.micro_batch * self.seq_len

    @property
    def mean_sample(self) -> float:
        """Real tokens per sample (at most seq_len)."""
        return min(self.sample_len, self.seq_len) if self.sample_len else float(self.seq_len)

    @property
    def attention_len(self) -> float:
        """The length attention runs over: a padded row's seq_len, or a packed sample's own length."""
        return self.mean_sample if self.packed else float(self.seq_len)

    @property
    def real_tokens(self) -> float:
        """Tokens of the data in one micro-batch: padded rows hold one sample each; a packed batch is taken as filled
        to its budget (the packer's slack, less than one sample, is not counted)."""
        if self.packed:
            return float(self.tokens)
        return self.micro_batch * self.mean_sample

    @property
    def labelled_share(self) -> float:
        """Labelled positions (the MLM head's rows) per position computed: padding is never labelled."""
        return self.labelled * self.real_tokens / self.tokens


@dataclass
class Breakdown:
    """Bytes per rank by item, the peak, what each moment of the step holds, and host memory (offload)."""

    items: dict[str, float] = field(default_factory=dict)
    peak: float = 0.0
    margin: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.peak + self.margin


@dataclass(frozen=True)
class ParamSummary:
    total: int
    largest: int
    persistent: int     # elements in parameters of at most PERSISTENCE elements
    tensors: int = 0    # parameter tensors (DeepSpeed's and AdamW's per-tensor work, train/plan/cpu_time.py)


def parameter_summary(models: tuple[ModelConfig, ...], rtd_sharing: str | None = None) -> ParamSummary:
    """Parameter count, largest parameter and ZeRO 3's persistent elements, from the configs' shapes."""
    sizes = (rtd_parameter_sizes(models[0], models[1], rtd_sharing or "gdes") if len(models) == 2
             else mlm_parameter_sizes(models[0]))
    return ParamSummary(sum(sizes), max(sizes), sum(n for n in sizes if n <= PERSISTENCE), len(sizes))


def act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def _shard(s: Setting) -> float:
    return s.params / s.ranks if s.zero >= 1 else s.params


def model_states(s: Setting) -> dict[str, float]:
    """What every rank keeps between steps on the GPU (bytes): weights, optimizer states, ZeRO 3's buffers."""
    a, shard = act_bytes(s.precision), _shard(s)
    on_gpu = 0 if s.offload_optimizer else 1
    if s.zero == 3:
        weights = 0 if s.offload_param else shard * a + s.persistent_params * a
    else:
        weights = s.params * a
    # ZeRO >= 1 clones an fp32 partition even in fp32; ZeRO 0 only in half precision (FP16_UnfusedOptimizer)
    separate_master = s.zero >= 1 or s.precision != "fp32"
    states = {"weights": weights,
              "fp32 master weights": shard * 4 * on_gpu if separate_master else 0.0,
              "Adam moments": 2 * shard * 4 * on_gpu}
    if s.zero == 3:
        states["reduce bucket (ZeRO 3, kept)"] = REDUCE_BUCKET * a
        states["gradient partitions (ZeRO 3, kept)"] = shard * a * on_gpu
    if s.offload_optimizer and s.zero in (1, 2):   # the copies' staging buffer, largest parameter's size
        states["offload copy buffer"] = s.largest_param * a
    return states


def host_states(s: Setting) -> dict[str, float]:
    """What optimizer (and ZeRO 3 parameter) offload keeps in host memory per rank (bytes)."""
    if not s.offload_optimizer and not s.offload_param:
        return {}
    shard, a = _shard(s), act_bytes(s.precision)
    host = {}
    if s.offload_optimizer:
        host.update({"fp32 master weights": shard * 4, "fp32 gradients": shard * 4, "Adam moments": 2 * shard * 4})
    if s.offload_param:
        host["weights (partition)"] = shard * a
    return host


def buckets(s: Setting) -> float:
    """ZeRO 1-2's contiguous reduce bucket(s), alive from the first gradient to the end of the backward."""
    if s.zero not in (1, 2):
        return 0.0
    return REDUCE_BUCKET * act_bytes(s.precision) * (2 if s.overlap_comm else 1)


def gathered_weights(s: Setting) -> float:
    """ZeRO 3: the weights gathered whole for their modules. With DeepSpeed's default
    ``stage3_max_reuse_distance`` (1e9 elements) a gathered parameter used again within that many elements is
    not released (partitioned_param_coordinator.py:653), and every weight's next use (its backward) is closer
    than that for models under 5e8 parameters: every partitioned weight stays gathered from its forward to its
    backward, up to ``stage3_max_live_parameters`` (1e9 elements). On CPU ranks gloo's all-gather adds an
    output buffer of the largest fetch (the word table), freed from gloo's thread."""
    if s.zero != 3:
        return 0.0
    elements = min(s.params - s.persistent_params, MAX_LIVE)
    return (elements + (0 if s.fused else s.largest_param)) * act_bytes(s.precision)


def dropout_mask_bytes(s: Setting) -> int:
    """Bytes per element of a kept dropout mask: a bool on GPUs (the fused CUDA dropout), the activation's own dtype
    on CPU ranks (``at::dropout`` off CUDA draws a noise tensor like its input and keeps it for the backward)."""
    return 1 if s.fused else act_bytes(s.precision)


def layer_activations(cfg: ModelConfig, s: Setting, tokens: int) -> float:
    """Bytes one layer application keeps for its backward."""
    a, d, i, h = act_bytes(s.precision), cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    mask = tokens * d * dropout_mask_bytes(s) if s.dropout and cfg.hidden_dropout_prob > 0 else 0
    # the layer input (also both residuals), Q, K, V (the fused op's contiguous copies; the reference keeps
    # float32 copies), the attention output, its [B, N, D] relayout as the output projection's input (a view on
    # the reference path), the LayerNorm-1 input, attended (LN-1 out), the LayerNorm-2 input
    attention = 4 * tokens * d * (a if s.fused else 4)
    # packed on the reference path: each sample's attention runs apart and their outputs are concatenated, a copy
    # the output projection keeps (kernels/reference.py disentangled_attention_varlen)
    hidden = (5 if s.fused or s.packed else 4) * tokens * d * a + attention
    ffn = 2 * tokens * i * a
    stats = 2 * tokens * 8 + tokens * h * 4                                   # LN mean/rstd, attention lse
    terms = len(cfg.pos_att_type) if cfg.relative_attention else 0
    tables = terms * 2 * cfg.att_span * d * a * (2 if mask else 1)           # Kr/Qr (+ the dropped-out rel)
    if not s.fused and a != 4:   # the reference's float32 copies of Kr/Qr, one per attention call: per packed sample
        calls = s.tokens / s.mean_sample if s.packed else 1
        tables += calls * terms * 2 * cfg.att_span * d * 4
    # the reference's relative-position index: one [N, N] of the padded batch, or one per packed sample
    span = s.attention_len
    index = 0 if s.fused or not cfg.relative_attention else (tokens * span if s.packed else span * span) * 8
    return hidden + ffn + stats + 2 * mask + tables + index


def score_buffer(cfg: ModelConfig, s: Setting, tokens: int) -> float:
    """Bytes of one dense position buffer of the fused attention, ``[H, tokens, 2k]`` in the activations' dtype
    (a term's scores or their gradient: kernels/attention/dense.py)."""
    return cfg.num_attention_heads * tokens * 2 * cfg.att_span * act_bytes(s.precision)


def kept_scores(cfg: ModelConfig, s: Setting, tokens: int) -> float:
    """The dense position scores (one :func:`score_buffer` a term) the fused attention keeps from its forward for
    its backward (``model.keep_position_scores``), counted wherever the dense designs may run (an upper bound, as
    :func:`transients` counts them)."""
    terms = len(cfg.pos_att_type) if cfg.relative_attention else 0
    if not (s.fused and cfg.keep_position_scores):
        return 0.0
    return terms * score_buffer(cfg, s, tokens)


def head_activations(cfg: ModelConfig, s: Setting, tokens: int) -> tuple[float, float]:
    """The MLM head's saved bytes and its largest transient (bytes) for ``tokens`` positions."""
    a, d, e, v = act_bytes(s.precision), cfg.hidden_size, cfg.embedding_size, cfg.vocab_size
    rows = round(tokens * s.labelled_share)
    kept = rows * (d + 2 * e) * a + rows * 8 * 2                                # dense in, GELU out, LN in, stats
    if s.fused:
        kept += v * e * 4 + v * 4 + rows * e * a                                 # decoder gradient, bias, rows
        return kept, min(rows, max(1, LOGITS_CHUNK // v)) * v * 4
    kept += rows * v * 4                                                         # log-softmax output
    return kept, rows * v * 4                                                    # the logits beside it


def activations(s: Setting) -> dict[str, float]:
    """Saved activations of one micro-batch (bytes), by part."""
    tokens = s.tokens
    a, found = act_bytes(s.precision), {}
    for n, cfg in enumerate(s.models):
        layers = layer_applications(cfg) if cfg.emd else cfg.num_hidden_layers
        scale = 1 if not cfg.activation_checkpointing else 0
        name = "" if len(s.models) == 1 else ("generator " if n == 0 else "discriminator ")
        per_layer = layer_activations(cfg, s, tokens)
        kept_inputs = layers * tokens * cfg.hidden_size * a       # a checkpointed layer keeps only its input
        found[f"{name}encoder layers"] = per_layer * layers * scale + kept_inputs * (1 - scale)
        if kept := kept_scores(cfg, s, tokens) * layers * scale:
            found[f"{name}{KEPT_SCORES}"] = kept
        embed_mask = (tokens * cfg.hidden_size * dropout_mask_bytes(s)
                      if s.dropout and cfg.hidden_dropout_prob > 0 else 0)
        found[f"{name}embeddings"] = tokens * cfg.embedding_size * a + embed_mask + tokens * 8
        if cfg.emd:
            found[f"{name}EMD keys/values"] = tokens * cfg.hidden_size * a
        if n == 0:
            found[f"{name}MLM head"] = head_activations(cfg, s, tokens)[0]
    return found


def attention_band(n: float, position_buckets: int, max_relative_positions: int) -> float:
    """An upper bound on the distances one backward block of the fused attention meets (``attention.band_range``,
    for tiles up to 64 x 64): the sequence's, rounded up to whole blocks on both sides, and, where the bucket table
    saturates within ``max_relative_positions`` of 0 (buckets no more than that, or none), that middle and a tile
    length on each side (tests/plan/test_plan_memory.py holds it to ``band_range``)."""
    sequence = n + 2 * 63
    return min(sequence, 2 * max_relative_positions + 2 * 127) if position_buckets <= max_relative_positions \
        else sequence


def transients(s: Setting) -> dict[str, float]:
    """The largest short-lived buffers: one recomputed layer, the head's logits, the backward of one layer."""
    tokens = s.tokens
    cfg = s.models[-1]
    a = act_bytes(s.precision)
    logits = head_activations(s.models[0], s, tokens)[1]
    out = {"MLM logits (transient)": logits}
    if not s.fused:   # the reference loss's backward: the log-softmax's input gradient beside the loss's, both
        out[HEAD_BACKWARD] = 2 * logits      # [M, V] float32, while the kept log-softmax output is still alive
    if cfg.activation_checkpointing:
        out["recomputed layer (transient)"] = layer_activations(cfg, s, tokens) + kept_scores(cfg, s, tokens)
    # dq, dk, dv and the feed-forward's input gradient; the fused attention backward adds its partial sums and
    # scratch, at most PARTIAL_BUDGET (1.0, kernels/attention/backward.py) x the bytes of dq + dk + dv
    grads = 3 * tokens * cfg.hidden_size * a
    if not s.fused and a != 4:   # the reference computes half precision in float32: dq, dk, dv and the output's
        grads += (3 + 1) * tokens * cfg.hidden_size * 4     # gradient in float32 beside their casts
    out["layer backward (transient)"] = grads * (2 if s.fused else 1) + tokens * cfg.intermediate_size * a
    terms = len(cfg.pos_att_type) if cfg.relative_attention else 0
    if s.fused and terms:
        # the dense position designs (kernels/attention/dense.py), which the kernels' planning picks per GPU and
        # length: the backward keeps one [H, tokens, 2k] score-gradient buffer and head-major copies of Q and K,
        # and, reading its scores densely, the two [H, tokens, 2k] score buffers it recomputes (unless the forward
        # kept them: an activation, kept_scores); the forward the two score buffers while a layer runs (kept:
        # already counted among the activations, unless a checkpointed layer's first forward drops them).
        # Counted wherever they may run (an upper bound).
        position = score_buffer(cfg, s, tokens)
        kept = cfg.keep_position_scores
        recomputed = 0 if kept else terms
        out["layer backward (transient)"] += (1 + recomputed) * position + 2 * tokens * cfg.hidden_size * a
        # and, a program per item (kernels/attention/backward.py, one_item_per_program), each block's band of
        # score gradients in distance coordinates, one kernel's at a time
        band = attention_band(s.attention_len, cfg.position_buckets, cfg.resolved_max_relative_positions)
        out["layer backward (transient)"] += cfg.num_attention_heads * tokens * band * a
        out[DENSE_SCORES] = 0.0 if kept and not cfg.activation_checkpointing else terms * position
    if not s.fused:   # the reference backward's score blocks and per-row position gradients: the padded batch's
        span, n = 2 * cfg.att_span, s.attention_len     # at once, a packed batch's one sample at a time
        rows = n if s.packed else s.micro_batch * n
        out["layer backward (transient)"] += rows * cfg.num_attention_heads * (3 * n + 2 * span) * 4
    return out


def step_buffers(s: Setting) -> dict[str, float]:
    """The step's buffers beyond the kept states (bytes), each alive at some moment of the step (:func:`phases`)."""
    a, shard, p = act_bytes(s.precision), _shard(s), s.params
    # ZeRO 2 keeps the rank's gradient partition (on the host with optimizer offload, stage_1_and_2.py:1888)
    partition = 0.0 if s.offload_optimizer else shard * a
    return {"gradients": p * a if s.zero <= 1 else partition if s.zero == 2 else 0.0,
            "reduce bucket(s)": buckets(s),
            "reduction's flat copy": min(p, REDUCE_BUCKET) * a if s.zero < 3 else 2 * (p - s.persistent_params) * a,
            "gathered weights and their gradient": gathered_weights(s),
            "fp32 gradients (step)": 0.0 if s.offload_optimizer or (s.precision == "fp32" and s.zero < 3) else shard * 4,
            # torch AdamW: foreach (CPU) keeps sqrt(v) of the whole partition; fused (GPU) keeps nothing
            "optimizer temporaries": 0.0 if s.fused or s.offload_optimizer else shard * 4,
            # ZeRO takes each gradient's norm on a float64 copy (stage_1_and_2.py:2684, stage3.py:2460)
            "gradient norm's float64 copy": (min(s.largest_param, shard) if s.zero < 3
                                             else s.largest_param / s.ranks) * 8 if s.zero else 0.0}


def _optimizer_moment(s: Setting, buf: dict[str, float]) -> float:
    """Bytes above the kept states at the optimizer step: the gradients, their fp32 copy (half precision; ZeRO 3
    flattens them in fp32 too), and the larger of the norm's float64 copy and AdamW's temporaries."""
    a, shard = act_bytes(s.precision), _shard(s)
    fp32_step = buf["fp32 gradients (step)"] + buf["optimizer temporaries"]
    if s.zero == 0:         # the gradients stay while FP16_UnfusedOptimizer makes fp32 copies of them
        return buf["gradients"] + fp32_step
    # the partition copied out of the bucket (stage_1_and_2.py:2192); offloaded, it goes to the host instead
    held = shard * a if s.zero < 3 and not s.offload_optimizer else 0.0
    norm = held + buf["gradient norm's float64 copy"]
    if s.precision == "fp32" and s.zero < 3:     # the partition is already fp32: the step reads it in place
        return max(norm, held + buf["optimizer temporaries"])
    return max(norm, fp32_step)


def phases(s: Setting, states: dict[str, float], acts: dict[str, float], temp: dict[str, float],
           buf: dict[str, float]) -> dict[str, float]:
    """Bytes alive at each candidate peak of a step (the moments of the module's docstring)."""
    a = act_bytes(s.precision)
    table, fixed, saved = s.largest_param * a, sum(states.values()), sum(acts.values())
    bucket, gathered = buf["reduce bucket(s)"], buf["gathered weights and their gradient"]
    # ZeRO 0, and ZeRO 1 without overlap_comm, keep every gradient in .grad until the reduction; ZeRO 2 or
    # overlap_comm copy each into the bucket as it is produced (stage_1_and_2.py:2290, 1452); ZeRO 3 reduces
    # them by the bucketful (stage3.py:1583)
    held = s.zero == 0 or (s.zero == 1 and not s.overlap_comm)
    others = (s.params - s.largest_param) * a if held else 0.0
    reduction = buf["reduction's flat copy"] + (buf["gradients"] if s.zero == 0 else 0.0)
    # the tied table's gradients: the decoder's, the lookup's and their sum (ZeRO 3's decoder gradient is summed
    # in its own partition: two)
    table_grads = (2 if s.zero == 3 else 3) * table
    # the reference head's backward makes the decoder's V x E gradient early (the fused loss made it in the forward:
    # an activation), while nearly every activation is alive; just before it, the loss's two [M, V] gradients
    others_temp = max(v for k, v in temp.items() if k not in (HEAD_BACKWARD, DENSE_SCORES))
    backward_start = max(others_temp + (0 if s.fused else table), temp.get(HEAD_BACKWARD, 0.0))
    forward_temp = max(temp["MLM logits (transient)"], temp.get(DENSE_SCORES, 0.0))
    return {"end of forward": fixed + saved + gathered + forward_temp,
            "start of backward": fixed + saved + gathered + bucket + backward_start,
            "word table's backward": fixed + bucket + gathered + others + table_grads,
            "reduction": fixed + bucket + gathered + reduction,
            "optimizer step": fixed + _optimizer_moment(s, buf),
            "weights all-gather": fixed + (s.params * a if s.zero in (1, 2) else 0.0)}


def step_peak(s: Setting) -> Breakdown:
    """Bytes per rank at the step's peak, with every item, and the allocator margin on top."""
    states, acts, temp, buf = model_states(s), activations(s), transients(s), step_buffers(s)
    moments = phases(s, states, acts, temp, buf)
    peak = max(moments.values())
    return Breakdown({**states, **acts, **temp, **buf}, peak, margin=margin(peak, s.fused), phases=moments,
                     host=host_states(s))


def model_states_bytes(s: Setting) -> float:
    """Model states as DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs`` count them: weights, gradients,
    fp32 master weights and gradients, moments, and at ZeRO 3 the largest layer gathered with its gradient."""
    states, buf = model_states(s), step_buffers(s)
    grads = buf["gradients"] if s.zero != 3 else states.get("gradient partitions (ZeRO 3, kept)", 0.0)
    gathered = 2 * s.largest_param * act_bytes(s.precision) if s.zero == 3 else 0.0
    return (states["weights"] + states["fp32 master weights"] + states["Adam moments"] + grads
            + buf["fp32 gradients (step)"] + gathered)


def margin(peak: float, on_gpu: bool = True) -> float:
    """The caching allocator's fragmentation (5 % of the tensors) plus, on GPUs, the CUDA context, kernels and
    NCCL buffers (1 GiB): assumptions, stated in the plan's output."""
    return 0.05 * peak + (1.0 * GIB if on_gpu else 0.0)
