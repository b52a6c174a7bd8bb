import json

import pytest

from dsflash.model.config import ModelConfig


def test_presets_and_roles():
    flash = ModelConfig.preset("flash")
    assert flash.first_decoder_layer == 20 and flash.kv_qat
    roles = flash.layer_roles
    assert roles[:2] == ("window", "window")
    assert [i for i, r in enumerate(roles) if r == "full"] == [2, 8, 14, 20]
    assert [i for i, r in enumerate(roles) if r == "reindex"] == [24, 28, 32, 36]
    assert flash.kv_source_of(7) == 2 and flash.kv_source_of(19) == 14 and flash.kv_source_of(39) == 20
    assert flash.topk_source_of(25) == 24 and flash.topk_source_of(21) == 20
    assert flash.uses_candidate_pool(24) and not flash.uses_candidate_pool(20)
    assert flash.rope_theta_of(0) == 10000.0 and flash.rope_theta_of(2) == 160000.0
    tiny = ModelConfig.preset("tiny")
    assert tiny.layer_roles == ("window", "full", "reuse", "reuse", "full", "reuse", "reindex", "reuse")
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        ModelConfig.preset("huge")


def test_json_round_trip(tmp_path):
    for name in ("tiny", "small", "flash"):
        cfg = ModelConfig.preset(name)
        path = tmp_path / f"{name}.json"
        cfg.to_json(path)
        assert ModelConfig.from_json(path) == cfg


def test_released_layout_with_text_config(tmp_path):
    flash = ModelConfig.preset("flash")
    text = flash.to_dict()
    text["compress_ratios"] = text["compress_ratios"] + [0, 0, 0]  # the 3 DSpark blocks
    text.pop("kv_qat")
    text["engram_pad_id"] = text.pop("engram_pad_token_id")  # transformers' spelling
    release = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
               "text_config": text, "vision_config": {"depth": 32}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(release))
    cfg = ModelConfig.from_json(path)
    assert cfg == flash.replace(kv_qat=False)
    assert len(cfg.compress_ratios) == 40


@pytest.mark.parametrize("change, message", [
    # layer 2 would become a Reuse layer reading ratio 2 with no ratio-2 source at or below it
    (dict(compress_ratios=(0, 1, 2, 2, 1, 1, 1, 1)), "layer 2 .* has no KV source with ratio 2"),
    (dict(candidate_source_layer_id=1), "candidate_source_layer_id=1 must be the last KV source"),
    (dict(index_source_layer_ids=(4, 6)), "KV source layer 1 is not in index_source_layer_ids"),
    (dict(kv_source_layer_ids=(1, 4, 5), index_source_layer_ids=(1, 4, 5, 6),
          candidate_source_layer_id=5), "KV source layer 5 is after the first decoder layer 4"),
    (dict(engram_layer_ids=(1, 6)), "Engram layer 6 is after the first decoder layer 4"),
    (dict(o_groups=3), "num_attention_heads=4 is not divisible by o_groups=3"),
    (dict(compress_ratios=(0, 2, 2)), "compress_ratios has 3 entries; num_hidden_layers=8"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim=7 must be a positive even number"),
    (dict(head_dim=8), "head_dim=8 must exceed qk_rope_head_dim=8"),
    (dict(num_experts_per_tok=9), r"num_experts_per_tok=9 must be in \[1, n_routed_experts=8\]"),
    (dict(kv_source_layer_ids=(0, 4), index_source_layer_ids=(0, 4, 6)),
     "KV source layer 0 has compress ratio 0"),
    (dict(sliding_window=0), "sliding_window=0 must be > 0"),
    (dict(max_position_embeddings=2**24 + 1), r"max_position_embeddings=16777217 must be in \[1, 16777216\]"),
    (dict(engram_num_embeddings=(5,)), "engram_num_embeddings has 1 entries for 2 Engram layers"),
])
def test_invalid_configs_raise(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.preset("tiny").replace(**change)
