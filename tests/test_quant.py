import pytest
import torch

from dsflash.model.cache import ModelCache
from dsflash.model.config import ModelConfig
from dsflash.model.model import DSFlashModel
from dsflash.model.quant import (
    E2M1_GRID,
    fp4_e4m3scale_qat,
    fp4_pow2_qat,
    fp8_e4m3_qat,
    round_e2m1,
)

from conftest import random_ids
from tolerances import MODEL, assert_close


def test_e2m1_rounds_to_nearest_ties_to_even_code():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 0.3, 2.9, 6.0, 0.0])
    # ties: 0.25 -> 0 (code 0), 0.75 -> 1 (code 2), 1.25 -> 1 (code 2), 1.75 -> 2 (code 4),
    # 2.5 -> 2 (code 4), 3.5 -> 4 (code 6), 5 -> 4 (code 6)
    expect = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 0.5, 3.0, 6.0, 0.0]
    assert round_e2m1(v).tolist() == expect


def test_round_trips_land_on_their_grids(gen):
    x = torch.randn(3, 64, generator=gen) * 5
    fp4 = fp4_pow2_qat(x)
    blocks = x.view(3, 2, 32)
    s = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True) / 6)))
    codes = (fp4.view(3, 2, 32) / s).abs()
    assert torch.isin(codes, torch.tensor(E2M1_GRID)).all()
    for fn in (fp8_e4m3_qat, fp4_pow2_qat, fp4_e4m3scale_qat):
        once = fn(x)
        assert torch.equal(fn(once), once), fn.__name__  # idempotent
        assert (once - x).abs().max() <= x.abs().max() / 2
    e4 = fp8_e4m3_qat(x)
    assert (e4 - x).abs().max() <= x.abs().max() * 2.0**-3


def test_quantisation_block_must_divide():
    with pytest.raises(ValueError, match="last dim 20 is not a multiple of the quantisation block 32"):
        fp4_pow2_qat(torch.zeros(20))


def test_kv_qat_model_decode_matches_forward(gen):
    cfg = ModelConfig.preset("tiny").replace(kv_qat=True, index_head_dim=32)
    model = DSFlashModel(cfg).init_weights(seed=3)
    ids = random_ids(gen, 1, 21, cfg.vocab_size)
    with torch.no_grad():
        full = model(ids)
        plain = DSFlashModel(cfg.replace(kv_qat=False)).init_weights(seed=3)(ids)
    cache = ModelCache.allocate(cfg, 1, 32)
    steps = torch.cat([model.decoder_step(ids[:, i:i + 1], cache, all_logits=True) for i in range(21)], 1)
    assert_close(steps, full, MODEL, "kv_qat decode")
    assert not torch.allclose(full, plain, atol=1e-3)  # the round-trips are really applied
