"""Parameter sizes from the configs' shapes equal the built models' (the planner counts parameters this way)."""

from __future__ import annotations

import pytest
import torch

from distaff.train.model.config import load_model_config
from distaff.train.model.deberta import DebertaForMaskedLM
from distaff.train.model.param_count import mlm_parameter_sizes, rtd_parameter_sizes
from distaff.train.model.rtd import ReplacedTokenDetection

SWITCHES = [{}, {"emd": True}, {"embedding_size": 64}, {"share_att_key": False}, {"tta": True},
            {"relative_attention": False, "position_biased_input": True, "type_vocab_size": 2},
            {"norm_rel_ebd": "none"}, {"pos_att_type": ["c2p"], "share_att_key": False}]


def built_sizes(model: torch.nn.Module) -> list[int]:
    return sorted(p.numel() for p in model.parameters())     # a shared table is one parameter


@pytest.mark.unit
def test_sizes_from_shapes_equal_the_built_models():
    cases = [("tiny", switches) for switches in SWITCHES] + [("deberta-v3-large", {})]
    for preset, switches in cases:
        cfg = load_model_config(preset, **switches)
        with torch.device("meta"):
            mlm = DebertaForMaskedLM(cfg)
        assert sorted(mlm_parameter_sizes(cfg)) == built_sizes(mlm), (preset, switches)


@pytest.mark.unit
@pytest.mark.parametrize("sharing", ["es", "gdes", "none"])
def test_rtd_sizes_from_shapes_equal_the_built_model(sharing):
    cfg = load_model_config("tiny", embedding_size=64 if sharing == "none" else None)
    generator = cfg.replace(num_hidden_layers=2, hidden_size=64, intermediate_size=256)
    with torch.device("meta"):
        rtd = ReplacedTokenDetection(generator, cfg, sharing=sharing)
    assert sorted(rtd_parameter_sizes(generator, cfg, sharing)) == built_sizes(rtd)
