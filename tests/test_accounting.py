import pytest
import torch

from dsflash.model.accounting import (
    count_parameters,
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
