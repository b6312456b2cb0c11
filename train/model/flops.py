"""Model FLOPs of DeBERTa MLM training and model FLOP utilisation (MFU).

Counted per token for one forward and backward pass (backward = 2x forward), matrix multiplies
only (a multiply-add is 2 FLOPs). Activation-checkpointing recomputation is not counted (MFU,
not hardware FLOP utilisation). Terms, per encoder layer application:

- Q, K, V and output projections: ``8 D^2``; feed-forward: ``4 D I``;
- content-to-content scores and the weighted sum of values: ``4 N D``;
- c2p and p2c: ``2 D min(N, 2k)`` each, the cheaper of the exact ways to form them (a score per
  query/key pair, or each query against the ``2k`` relative-position keys, then a gather);
- the relative-position projections ``key_proj(R)`` / ``query_proj(R)``: ``2 (2k) D^2`` each per
  sequence, i.e. divided by ``N`` per token.

With EMD the encoder's last layer is replaced by ``emd_layers`` applications of its weights
(``L - 1 + n`` applications in all). The MLM head (dense ``D x E`` and the ``E x V`` decoder) runs
only on labelled tokens, so it is weighted by the labelled fraction.
"""

from __future__ import annotations

from distaff.train.model.config import ModelConfig

# Dense (no sparsity) peak FLOP/s from vendor datasheets: (name fragment, bf16/fp16 tensor, fp32).
# Matched against torch.cuda.get_device_name(); more specific names first.
PEAK_FLOPS = (
    ("H100 PCIe", 756e12, 51e12),
    ("H100 NVL", 835e12, 60e12),
    ("H100", 989e12, 67e12),
    ("H200", 989e12, 67e12),
    ("GH200", 989e12, 67e12),
    ("A100", 312e12, 19.5e12),
    ("L40S", 362e12, 91.6e12),
    ("L4", 121e12, 30.3e12),
    ("A10", 125e12, 31.2e12),
    ("RTX 4090", 165e12, 82.6e12),
    ("V100", 125e12, 15.7e12),
)


def layer_applications(cfg: ModelConfig) -> int:
    """Encoder-layer passes per forward: EMD replaces the last layer by ``emd_layers`` passes."""
    return cfg.num_hidden_layers - 1 + cfg.emd_layers if cfg.emd else cfg.num_hidden_layers


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, labelled_fraction: float) -> float:
    """Forward-pass FLOPs per token position for sequences of ``seq_len`` tokens."""
    d, n = cfg.hidden_size, seq_len
    position_rows = 2 * cfg.att_span
    terms = len(cfg.pos_att_type) if cfg.relative_attention else 0
    layer = (8 * d * d + 4 * d * cfg.intermediate_size + 4 * n * d
             + terms * 2 * d * min(n, position_rows)
             + terms * 2 * position_rows * d * d / n)
    embedding = 2 * cfg.embedding_size * d if cfg.embedding_size != d else 0
    head = labelled_fraction * (2 * d * cfg.embedding_size + 2 * cfg.embedding_size * cfg.vocab_size)
    return layer_applications(cfg) * layer + embedding + head


def train_flops_per_token(cfg: ModelConfig, seq_len: int, labelled_fraction: float = 0.15) -> float:
    """Forward + backward FLOPs per token position (backward costs twice the forward)."""
    return 3.0 * forward_flops_per_token(cfg, seq_len, labelled_fraction)


def peak_flops(device_name: str, precision: str) -> float | None:
    """Datasheet peak FLOP/s of one device for ``precision`` (fp32|bf16|fp16); None if unknown (CPUs)."""
    for fragment, tensor_peak, fp32_peak in PEAK_FLOPS:
        if fragment.lower() in device_name.lower():
            return fp32_peak if precision == "fp32" else tensor_peak
    return None


def mfu(tokens_per_s_per_device: float, flops_per_token: float, peak: float | None) -> float | None:
    """Achieved model FLOP/s as a fraction of ``peak`` (None when the peak is unknown)."""
    if not peak:
        return None
    return tokens_per_s_per_device * flops_per_token / peak
