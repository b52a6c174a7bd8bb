import pytest
import torch

from dsflash.model.model import DSFlashModel
from dsflash.model.weights import load_safetensors, save_safetensors

from conftest import random_ids


def test_release_names(tiny_model):
    names = set(tiny_model.state_dict())
    for name in ("embed.weight", "head.weight", "norm.weight", "layers.0.attn.wq_a.weight",
                 "layers.0.attn.attn_sink", "layers.0.hc_attn_fn", "layers.0.hc_ffn_scale",
                 "layers.1.attn.compressor.wgate.weight", "layers.4.attn.compressor.wkv.weight",
                 "layers.1.attn.indexer.wk.weight", "layers.6.attn.indexer.weights_proj.weight",
                 "layers.1.engram.embed.weight", "layers.3.engram.q_weight",
                 "layers.2.ffn.gate.bias", "layers.2.ffn.gate.bias_vl",
                 "layers.2.ffn.experts.7.w2.weight", "layers.2.ffn.shared_experts.w1.weight"):
        assert name in names, name
    assert "layers.4.attn.compressor.wgate.weight" not in names  # ratio-1 source has no gate
    assert "layers.6.attn.indexer.wk.weight" not in names       # index keys only at KV sources
    assert not any(n.startswith("model.") for n in names)


def test_safetensors_round_trip(tiny_model, tiny_cfg, tmp_path, gen):
    path = tmp_path / "w.safetensors"
    save_safetensors(tiny_model, path)
    other = DSFlashModel(tiny_cfg).init_weights(seed=99)
    load_safetensors(other, path)
    ids = random_ids(gen, 1, 9, tiny_cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(other(ids), tiny_model(ids))


def test_mismatched_checkpoint_refused(tiny_model, tiny_cfg, tmp_path):
    from safetensors.torch import save_file
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    state.pop("norm.weight")
    save_file(state, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        load_safetensors(DSFlashModel(tiny_cfg), tmp_path / "missing.safetensors")
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    state["norm.weight"] = torch.ones(3)
    save_file(state, str(tmp_path / "shape.safetensors"))
    fresh = DSFlashModel(tiny_cfg)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"norm.weight has shape \(3,\), the model expects \(64,\)"):
        load_safetensors(fresh, tmp_path / "shape.safetensors")
    # refused before any copy: the model keeps its own weights, none of the checkpoint's
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert not torch.equal(fresh.embed.weight, tiny_model.embed.weight)
