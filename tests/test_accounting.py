import pytest
import torch

from dsflash.model.accounting import (
    count_parameters,
    decode_step_bytes,
    global_kv_bytes_per_token,
    max_sequences,
    per_sequence_bytes,
    sequence_bytes,
)
from dsflash.model.config import ModelConfig
from dsflash.model.model import DSFlashModel


@pytest.fixture(scope="module")
def flash():
    return ModelConfig.preset("flash")


def test_flash_kv_bytes(flash):
    assert global_kv_bytes_per_token(flash, "released") == 890
    assert global_kv_bytes_per_token(flash, "bf16") == 3200
    consts = per_sequence_bytes(flash, "released")
    assert consts["swa_rings"] == 40 * 128 * 528  # 2.70 MB
    assert consts["compressor_state"] == 3 * 2 * 512 * 4
    with pytest.raises(ValueError, match="unknown cache format 'fp8'"):
        global_kv_bytes_per_token(flash, "fp8")


def test_max_sequences_by_hand(flash):
    ctx = 131072
    entries = 3 * (ctx // 2) + ctx  # three ratio-2 sources and one ratio-1 source
    per_seq = entries * (288 + 68) + 40 * 128 * 528 + 3 * 2 * 512 * 4 + 3 * 8 + 3 * 8
    assert sequence_bytes(flash, ctx) == per_seq
    budget = 80 * 2**30
    assert max_sequences(flash, budget, ctx) == budget // per_seq


@pytest.mark.slow
def test_flash_parameter_counts_on_meta(flash):
    with torch.device("meta"):
        model = DSFlashModel(flash)
    counts = count_parameters(model, flash)
    assert counts.engram_tables == (384_006_168 + 384_016_682) * 256
    assert abs(counts.backbone / 1e9 - 552) < 1.0
    assert abs(counts.activated_decode_row / 1e9 - 16) < 0.5
    assert abs(counts.activated_prefill_row / 1e9 - 8) < 0.5
    assert counts.activated_prefill_row < counts.activated_decode_row / 1.8


def test_decode_step_bytes_by_hand(tiny_cfg):
    """tiny at 48 cached tokens, bf16. Per row: 8 rings x 8 rows x 32; 7 compressed layers x 4
    selected x 32; index keys x 16 of Full layer 1 (ratio 2: 24 entries) and Full layer 4 (48),
    and of Reindex layer 6 only its candidate pool (2 blocks x 4 entries). Weights: everything
    once but the embedding / Engram tables (the rows gathered) and the routed experts (batch 1
    picks k = 2 of E = 8: a quarter of them; many rows pick them all)."""
    with torch.device("meta"):
        model = DSFlashModel(tiny_cfg)
    per_row = 8 * 8 * 32 + 7 * 4 * 32 + (24 + 48 + 8) * 16
    got = decode_step_bytes(model, tiny_cfg, 2, 48)
    assert got["cache"] == 2 * per_row * 2
    experts = tables = 0
    for name, p in model.named_parameters():
        experts += p.numel() if ".ffn.experts." in name else 0
        tables += p.numel() if name == "embed.weight" or ".engram.embed." in name else 0
    rest = sum(p.numel() for p in model.parameters()) - experts - tables
    rows = tiny_cfg.hidden_size + len(tiny_cfg.engram_layer_ids) * tiny_cfg.engram_heads_total * \
        tiny_cfg.engram_head_dim
    assert decode_step_bytes(model, tiny_cfg, 1, 48)["weights"] == round((rest + rows + experts / 4) * 2)
    many = decode_step_bytes(model, tiny_cfg, 10_000, 48)["weights"]
    assert many == round(2 * (rest + experts + tables))  # every expert, every table row
