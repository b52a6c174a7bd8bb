"""Engram addressing and gate (ARCHITECTURE.md Part B §3, §10 test 6)."""

import numpy as np
import pytest
import torch

from dsflash.model.config import ModelConfig
from dsflash.model.engram import engram_gate_update
from dsflash.model.engram_hash import (
    build_compression_map,
    layer_addressing,
    normalize_token_text,
    synthetic_compression_map,
)
from dsflash.plugins.engram_hash_gather.reference import engram_hash_rows


def hash_rows(cids, addr, heads):
    return engram_hash_rows(cids, list(addr.multipliers), list(addr.primes), list(addr.offsets),
                            addr.pad_id, heads)


FLASH_MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}
ALL_PAD_ROWS_L1 = [4299726, 29253038, 43157972, 58397134, 65256332, 88876378, 100686433, 112312540,
                   129401291, 144510675, 170979806, 184903880, 199719089, 215127204, 230239700,
                   250883315, 264341430, 275127613, 298781502, 318608685, 331826823, 351654054,
                   365224186, 370096053]


@pytest.fixture(scope="module")
def flash_addressing():
    cfg = ModelConfig.preset("flash")
    # pad (2) must map to compressed id 2, as in the release ("pad id 2 -> compressed 2").
    vocab_map = np.arange(cfg.vocab_size) % cfg.engram_compressed_vocab_size
    return cfg, layer_addressing(cfg, vocab_map)


def test_flash_primes_sum_to_table_rows(flash_addressing):
    cfg, addr = flash_addressing
    assert addr[1].rows == 384_006_168 and addr[14].rows == 384_016_682
    primes = list(addr[1].primes) + list(addr[14].primes)
    assert len(set(primes)) == 48 and min(primes) > cfg.engram_vocab_size
    assert addr[1].primes[:3] == (16000057, 16000079, 16000081)
    assert addr[14].primes[-1] == 16000889
    assert addr[1].offsets[1] == 16000057 and addr[1].offsets[-1] == 368005705


def test_flash_multipliers_are_exact_ints(flash_addressing):
    _, addr = flash_addressing
    for layer, expected in FLASH_MULTIPLIERS.items():
        got = addr[layer].multipliers
        assert all(type(m) is int for m in got)
        assert list(got) == expected


def test_all_pad_context_row_ids(flash_addressing):
    cfg, addr = flash_addressing
    cids = torch.full((1, 4), 2, dtype=torch.int64)  # lookback of pads, current token pad
    rows = hash_rows(cids, addr[1], cfg.engram_n_heads)
    assert rows[0, 0].tolist() == ALL_PAD_ROWS_L1
    # Positions before the start are blocked and read as pad: same rows for a pad at position 0.
    start = torch.tensor([[-1, -1, -1, 2]])
    assert hash_rows(start, addr[1], cfg.engram_n_heads)[0, 0].tolist() == ALL_PAD_ROWS_L1


@pytest.mark.parametrize("split", [1, 2, 3, 7, 19])
def test_hashes_identical_whole_or_split(tiny_cfg, gen, split):
    addr = layer_addressing(tiny_cfg, synthetic_compression_map(512, 256))[1]
    n, look = 20, tiny_cfg.engram_max_ngram_size - 1
    ids = torch.randint(0, 256, (2, n), generator=gen)
    pad = torch.full((2, look), -1)
    whole = hash_rows(torch.cat((pad, ids), 1), addr, tiny_cfg.engram_n_heads)
    first = hash_rows(torch.cat((pad, ids[:, :split]), 1), addr, tiny_cfg.engram_n_heads)
    hist = torch.cat((pad, ids[:, :split]), 1)[:, -look:]
    second = hash_rows(torch.cat((hist, ids[:, split:]), 1), addr, tiny_cfg.engram_n_heads)
    assert torch.equal(torch.cat((first, second), 1), whole)
    assert int(whole.min()) >= 0 and int(whole.max()) < addr.rows


def test_dead_token_blocks_longer_ngrams(tiny_cfg):
    addr = layer_addressing(tiny_cfg, synthetic_compression_map(512, 256))[1]
    h = tiny_cfg.engram_n_heads
    a = hash_rows(torch.tensor([[5, 6, -1, 9]]), addr, h)[0, 0]
    b = hash_rows(torch.tensor([[7, 8, -1, 9]]), addr, h)[0, 0]
    c = hash_rows(torch.tensor([[5, 6, 4, 9]]), addr, h)[0, 0]
    assert torch.equal(a, b)  # nothing before the dead token leaks through
    assert not torch.equal(a[:h], c[:h])


def test_gate_is_half_when_d_is_zero():
    h = torch.randn(1, 1, 4, 8)
    kv = torch.zeros(1, 1, 5 * 8)
    kv[..., 32:] = 1.0  # value = 1, keys = 0 -> d = 0 -> sqrt(clamp) = 1e-3, sign(0) = 0
    out = engram_gate_update(h, kv, torch.ones(4, 8), torch.ones(4, 8), 1e-20)
    assert torch.allclose(out - h, torch.full_like(h, 0.5))


def test_gate_signed_square_root():
    h = torch.ones(1, 1, 1, 4)
    kv = torch.cat((torch.ones(1, 1, 4), torch.full((1, 1, 4), 2.0)), -1)
    # d = sum(h*w*k) * rsqrt(1) * rsqrt(1) / sqrt(4) = 4 / 2 = 2; g = sigmoid(sqrt 2)
    out = engram_gate_update(h, kv, torch.ones(1, 4), torch.ones(1, 4), 1e-20)
    g = torch.sigmoid(torch.tensor(2.0).sqrt())
    assert torch.allclose(out, h + 2.0 * g)


def test_normalizer_and_compression_map():
    assert normalize_token_text("  Café\tNoir\n") == "cafe noir"
    assert normalize_token_text(" ") == " "
    assert normalize_token_text("\n\t") == " "
    assert normalize_token_text("ＡＢ") == "ab"  # NFKC folds full-width letters
    texts = ["a", "A", " a", "é", "e", "\ufffd", "\ufffd", "x"]
    raw = ["a", "A", "Ġa", "é", "e", "<0xE2>", "<0x82>", "x"]
    m = build_compression_map(len(texts), texts.__getitem__, raw.__getitem__)
    assert m.tolist() == [0, 0, 0, 1, 1, 2, 3, 4]  # " a" strips to "a"
