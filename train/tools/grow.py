"""``distaff grow CKPT OUT``: a wider and/or deeper model that computes exactly what the trained one did.

Function-preserving expansion, to continue pretraining a bigger model from a smaller one.

**Wider** (``hidden_size`` times an integer ``k``; ``intermediate_size`` any larger value). Every
hidden-sized vector of the small model becomes ``k`` side-by-side copies of itself, and attention
gets ``k`` copies of each head (same head size, so the softmax scale and RoPE are unchanged).
A LayerNorm over ``k`` copies of a vector has the same mean and variance as over the vector
itself, so post-LN DeBERTa stays exact. A linear layer that writes a widened space copies its
rows; one that reads it splits each weight over the copies of its input, with random shares that
sum to one (Net2Net divides evenly; uneven shares give the copies different gradients, so they
can drift apart in training instead of staying copies forever). New feed-forward units copy
random existing ones (Net2Net) and their outgoing weights are split the same way. When the word
embeddings are widened too (``embedding_size == hidden_size``), the MLM head's LayerNorm scales
its output by ``1/k``, because the tied decoder reads ``k`` copies.

**Deeper.** A post-LN layer whose sublayers output zero still applies two LayerNorms, and
``LN(x)`` is not ``x`` for the affine output ``x = g * n + b`` of the previous LayerNorm. So the
new layers go in as a block before the last layer (the one the Enhanced Mask Decoder reuses), the
previous LayerNorm's affine ``(g, b)`` moves to the block's final LayerNorm and the previous one
becomes ``(1, 0)``: the block receives the normalised ``n``, its LayerNorms (``(1, 0)`` inside)
map ``n`` to ``n`` (it already has mean 0 and variance 1, up to ``layer_norm_eps``) and the
last one restores ``g * n + b``. Attention output and feed-forward output projections start at
zero; queries, keys, values and the feed-forward expansion are freshly initialised.

The output is a distaff model folder (:mod:`distaff.train.run.model_folder`: every weight, EMD
included, the config and the tokenizer) that ``model.init_from`` starts a run from; the continued
run's checkpoints export to Hugging Face as usual (``distaff export-hf``).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

from distaff.train.core.errors import MAX_SEED, command_main, document_ranges, int_arg
from distaff.train.core.files import check_out_dir, replaced_folder
from distaff.train.core.threads import configure_threads
from distaff.train.model.config import ConfigError, ModelConfig
from distaff.train.model.deberta import DebertaForMaskedLM, Layer
from distaff.train.run.checkpoint_files import check_apart_from_checkpoints
from distaff.train.run.model_folder import load_model, save_model_folder

# the largest sizes a grown model may ask for: far above any encoder, far below what an allocation overflows at
MAX_WIDTH, MAX_DEPTH = 1 << 18, 1024        # hidden and feed-forward sizes; layers and heads

# Which space each dimension of a parameter lives in: D hidden, E embedding, I feed-forward, None
# unchanged; a trailing "*" marks a linear layer's input (its weights are split over copies).
PARAMETER_SPACES = (
    (r"lm_head\.dense\.weight$", ("E", "D*")), (r"lm_head\.dense\.bias$", ("E",)),
    (r"lm_head\.LayerNorm\.(weight|bias)$", ("E",)), (r"lm_head\.bias$", (None,)),
    (r"emd\.position_embeddings\.weight$", (None, "D")), (r"rel_embeddings\.weight$", (None, "D")),
    (r"embeddings\.(word|position|token_type)_embeddings\.weight$", (None, "E")),
    (r"embed_proj\.weight$", ("D", "E*")),
    (r"_proj\.weight$", ("D", "D*")), (r"_proj\.bias$", ("D",)),
    (r"attention\.output\.dense\.weight$", ("D", "D*")),
    (r"intermediate\.dense\.weight$", ("I", "D*")), (r"intermediate\.dense\.bias$", ("I",)),
    (r"layer\.\d+\.output\.dense\.weight$", ("D", "I*")),
    (r"\.dense\.bias$|LayerNorm\.(weight|bias)$", ("D",)),
)


def parameter_spaces(name: str) -> tuple[str | None, ...]:
    for pattern, spaces in PARAMETER_SPACES:
        if re.search(pattern, name):
            return spaces
    raise ValueError(f"distaff grow: no widening rule for parameter {name!r}")


class Widening:
    """For each space, the small-model index behind every index of the wide model, and copy counts."""

    def __init__(self, small: ModelConfig, wide: ModelConfig, generator: torch.Generator):
        self.factor = wide.hidden_size // small.hidden_size
        d, i = small.hidden_size, small.intermediate_size
        extra = torch.randint(0, i, (wide.intermediate_size - i,), generator=generator)
        embed_wide = small.embedding_size == small.hidden_size
        self.sources = {"D": torch.arange(wide.hidden_size) % d, "I": torch.cat([torch.arange(i), extra]),
                        "E": torch.arange(wide.embedding_size) % small.embedding_size}
        self.sizes = {"D": d, "I": i, "E": small.embedding_size}
        self.embed_factor = self.factor if embed_wide else 1
        self.generator = generator

    def shares(self, space: str, rows: int) -> torch.Tensor:
        """``[rows, wide size]`` random positive shares summing to one over each input's copies."""
        source = self.sources[space]
        raw = 1.0 + 0.5 * torch.rand(rows, len(source), generator=self.generator, dtype=torch.float64)
        totals = torch.zeros(rows, self.sizes[space], dtype=torch.float64).index_add_(1, source, raw)
        return raw / totals[:, source]

    def widen(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        spaces = parameter_spaces(name)
        out = tensor.double()
        for dim, space in enumerate(spaces):
            if space is not None:
                out = out.index_select(dim, self.sources[space.rstrip("*")])
        if spaces[-1] is not None and spaces[-1].endswith("*"):
            out = out * self.shares(spaces[-1].rstrip("*"), out.shape[0])
        if name.startswith("lm_head.LayerNorm."):  # the tied decoder reads embed_factor copies
            out = out / self.embed_factor
        return out.to(tensor.dtype)


def grown_config(small: ModelConfig, hidden_size: int, num_layers: int, intermediate_size: int | None,
                 heads: int | None) -> ModelConfig:
    """The grown model's config; an expansion this module cannot make exactly is a ConfigError."""
    for switch, why in (("realformer", "new layers' scores would join every later layer's residual scores"),
                        ("tta", "its position-query table is not among the weights this module widens or keeps")):
        if getattr(small, switch):
            raise ConfigError(f"model.{switch} with distaff grow: growth is not function-preserving for it ({why}); "
                              "train the larger model from scratch")
    if hidden_size < small.hidden_size or hidden_size % small.hidden_size:
        raise ConfigError(f"--hidden-size {hidden_size}: must be a multiple of the model's hidden_size "
                          f"{small.hidden_size} (exact widening copies the hidden vector a whole number of times)")
    factor = hidden_size // small.hidden_size
    if heads is not None and heads != small.num_attention_heads * factor:
        raise ConfigError(f"--heads {heads}: widening by {factor} keeps the head size {small.head_dim}, so the "
                          f"model gets {small.num_attention_heads * factor} heads (each head copied {factor} times)")
    if num_layers < small.num_hidden_layers:
        raise ConfigError(f"--num-layers {num_layers}: fewer than the model's {small.num_hidden_layers} layers")
    intermediate = small.intermediate_size * factor if intermediate_size is None else intermediate_size
    if intermediate < small.intermediate_size:
        raise ConfigError(f"--intermediate-size {intermediate}: smaller than the model's {small.intermediate_size}")
    embedding = hidden_size if small.embedding_size == small.hidden_size else small.embedding_size
    return small.replace(hidden_size=hidden_size, num_attention_heads=small.num_attention_heads * factor,
                         intermediate_size=intermediate, num_hidden_layers=num_layers, embedding_size=embedding)


def _previous_layer_norm(index: int) -> str:
    """The LayerNorm whose output the layer at ``index`` reads."""
    return "deberta.embeddings.LayerNorm" if index == 0 else f"deberta.encoder.layer.{index - 1}.output.LayerNorm"


def identity_layer(cfg: ModelConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A layer's weights (names relative to the layer) with zero output projections: ``LN(LN(x))``."""
    layer = Layer(cfg)
    state = {}
    for name, tensor in layer.state_dict().items():
        if name in ("attention.output.dense.weight", "output.dense.weight") or name.endswith(".bias"):
            state[name] = torch.zeros_like(tensor)
        elif name.endswith("LayerNorm.weight"):
            state[name] = torch.ones_like(tensor)
        else:  # the model's initialisation: N(0, initializer_range)
            state[name] = torch.randn(tensor.shape, generator=generator) * cfg.initializer_range
    return state


def deepen(state: dict[str, torch.Tensor], cfg: ModelConfig, num_layers: int,
           generator: torch.Generator) -> dict[str, torch.Tensor]:
    """``state`` of ``cfg`` with ``num_layers - L`` identity layers inserted before the last layer."""
    added, last = num_layers - cfg.num_hidden_layers, cfg.num_hidden_layers - 1
    if added == 0:
        return dict(state)
    last_prefix = f"deberta.encoder.layer.{last}."
    grown = {(k.replace(last_prefix, f"deberta.encoder.layer.{num_layers - 1}.") if k.startswith(last_prefix)
              else k): v for k, v in state.items()}  # the last layer moves to the end
    for n in range(last, last + added):
        grown.update({f"deberta.encoder.layer.{n}.{k}": v for k, v in identity_layer(cfg, generator).items()})
    # the previous LayerNorm's affine moves to the block's last LayerNorm (see the module docstring)
    previous, final = _previous_layer_norm(last), f"deberta.encoder.layer.{last + added - 1}.output.LayerNorm"
    for part, neutral in (("weight", torch.ones_like), ("bias", torch.zeros_like)):
        grown[f"{final}.{part}"] = state[f"{previous}.{part}"].clone()
        grown[f"{previous}.{part}"] = neutral(state[f"{previous}.{part}"])
    return grown


def grow_model(model: DebertaForMaskedLM, hidden_size: int, num_layers: int, intermediate_size: int | None = None,
               heads: int | None = None, seed: int = 0) -> DebertaForMaskedLM:
    """A wider and/or deeper model whose outputs equal ``model``'s (widening first, then depth)."""
    small = model.config
    target = grown_config(small, hidden_size, num_layers, intermediate_size, heads)
    generator = torch.Generator().manual_seed(seed)
    wide_cfg = target.replace(num_hidden_layers=small.num_hidden_layers)
    widening = Widening(small, wide_cfg, generator)
    state = {k: widening.widen(k, v) for k, v in model.state_dict().items()}
    grown = DebertaForMaskedLM(target)
    grown.load_state_dict(deepen(state, wide_cfg, num_layers, generator), strict=True)
    return grown


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff grow", _main, argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="distaff grow", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint, run directory, distaff model folder or HF folder")
    parser.add_argument("out", help="output distaff model folder (start a run from it with model.init_from=OUT)")
    parser.add_argument("--hidden-size", type=int_arg("--hidden-size", low=1, high=MAX_WIDTH),
                        help="new hidden size, a multiple of the current one")
    parser.add_argument("--num-layers", type=int_arg("--num-layers", low=1, high=MAX_DEPTH),
                        help="new number of layers (inserted before the last one)")
    parser.add_argument("--intermediate-size", type=int_arg("--intermediate-size", low=1, high=MAX_WIDTH),
                        help="new feed-forward size (default: scaled with width)")
    parser.add_argument("--heads", type=int_arg("--heads", low=1, high=MAX_DEPTH),
                        help="attention heads (must be heads x width factor: head size kept)")
    parser.add_argument("--seed", type=int_arg("--seed", high=MAX_SEED), default=0,
                        help="seed of the new weights and the weight shares")
    parser.add_argument("--overwrite", action="store_true", help="write into OUT even if it already holds files")
    args = document_ranges(parser).parse_args(argv)
    configure_threads(announce=False)
    check_apart_from_checkpoints(("output folder", args.out), [("model", args.model)])
    check_out_dir(Path(args.out), args.overwrite)
    model, tokenizer = load_model(args.model)
    small = model.config
    # "is None", not "or": --hidden-size 0 is a value to refuse, not "keep the size"
    grown = grow_model(model, small.hidden_size if args.hidden_size is None else args.hidden_size,
                       small.num_hidden_layers if args.num_layers is None else args.num_layers,
                       args.intermediate_size, args.heads, args.seed)
    with replaced_folder(args.out) as fresh:     # --overwrite: no file of the old folder survives
        save_model_folder(grown, fresh, tokenizer)
    before, after = (sum(p.numel() for p in m.parameters()) / 1e6 for m in (model, grown))
    c = grown.config
    print(f"distaff grow: wrote {args.out}: {before:.2f}M -> {after:.2f}M parameters (hidden {c.hidden_size}, "
          f"{c.num_hidden_layers} layers, {c.num_attention_heads} heads, feed-forward {c.intermediate_size}); "
          f"continue pretraining with model.init_from={args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
