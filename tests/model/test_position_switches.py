"""The position switches a run can combine: absolute (BERT-style), relative (c2p/p2c), RoPE, EMD."""

from __future__ import annotations

import pytest
import torch

from distaff.train.model.config import load_model_config
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.model.flops import forward_flops_per_token
from distaff.train.run.config import ConfigError, load_config

pytestmark = pytest.mark.unit

ABSOLUTE = ["model.relative_attention=false", "model.pos_att_type=[]", "model.position_biased_input=true"]


def test_relative_terms_without_relative_attention_name_both_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"model.pos_att_type \['p2c', 'c2p'\] needs model.relative_attention: true"):
        load_config(None, ["data.dir=x", "model.relative_attention=false"])
    cfg = load_config(None, ["data.dir=x", *ABSOLUTE, "model.emd=false", "model.rope=true"]).model_config()
    assert (cfg.relative_attention, cfg.pos_att_type, cfg.position_biased_input, cfg.rope) == (False, [], True, True)


def test_absolute_positions_flops_have_no_relative_terms():
    relative = load_model_config("tiny", vocab_size=1000)
    absolute = relative.replace(relative_attention=False, pos_att_type=[], position_biased_input=True)
    d, i, n = 128, 512, 128
    head = 0.15 * (2 * d * d + 2 * d * 1000)
    assert forward_flops_per_token(absolute, n, 0.15) == pytest.approx(4 * (8 * d * d + 4 * d * i + 4 * n * d) + head)
    assert forward_flops_per_token(relative, n, 0.15) > forward_flops_per_token(absolute, n, 0.15)


@pytest.mark.parametrize("switches", [
    dict(relative_attention=False, pos_att_type=[], position_biased_input=True, emd=True),
    dict(relative_attention=False, pos_att_type=[], rope=True, emd=True),
    dict(rope=True, position_biased_input=True),
])
def test_switch_combinations_train(switches):
    torch.manual_seed(0)
    model = DebertaForMaskedLM(load_model_config("tiny", vocab_size=100, num_hidden_layers=2, **switches))
    ids = torch.randint(5, 100, (2, 32))
    labels = torch.where(torch.rand(2, 32) < 0.3, ids, -100)
    model(ids, labels=labels).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # each scheme sees position: moving every token one place changes its output
    with torch.no_grad():
        out = model.eval()(ids).last_hidden_state
        shifted = model(ids.roll(1, dims=1)).last_hidden_state.roll(-1, dims=1)
    assert (out - shifted).abs().max() > 1e-4
