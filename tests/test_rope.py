"""The rotary frequencies stay fp64 whatever dtype the model is converted to: a model-wide
`.to(bfloat16)` used to round them to bf16 (angles off by radians from a few thousand positions),
and `.to(float32)` to fp32 (another model than the one built)."""

import torch

from dsflash.model.model import DSFlashModel
from dsflash.model.norm_rope import Rotary, rope_frequencies

from conftest import random_ids


def test_a_dtype_conversion_keeps_the_rotary_frequencies_fp64(tiny_cfg, gen):
    model = DSFlashModel(tiny_cfg).init_weights(seed=2).eval()
    ids = random_ids(gen, 1, 11, tiny_cfg.vocab_size)
    with torch.no_grad():
        before = model(ids)
        assert torch.equal(model.to(torch.float32)(ids), before)  # a no-op conversion stays one
    pos = torch.tensor([3, 4095, 131071])
    fp32_tables = [r.cos_sin(pos) for r in model.modules() if isinstance(r, Rotary)]
    model.to(torch.bfloat16)
    rotaries = [r for r in model.modules() if isinstance(r, Rotary)]
    assert rotaries and all(r.freqs.dtype == torch.float64 for r in rotaries)
    for r in rotaries:
        assert torch.equal(r.freqs, rope_frequencies(*r._args))
    # the bf16 model's angles are the fp32 model's, to the last bit, at 128K positions too
    for r, (cos, sin) in zip(rotaries, fp32_tables):
        got_cos, got_sin = r.cos_sin(pos)
        assert torch.equal(got_cos, cos) and torch.equal(got_sin, sin)
