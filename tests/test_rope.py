"""The rotary tables: formed in fp32 within fp32's rounding floor of the fp64 angles at every
position up to POSITION_LIMIT, and kept so whatever dtype the model is converted to (a model-wide
`.to(bfloat16)` used to round the frequencies to bf16: angles off by radians from a few thousand
positions)."""

import pytest
import torch

from dsflash.model.config import ModelConfig
from dsflash.model.model import DSFlashModel
from dsflash.model.norm_rope import POSITION_LIMIT, Rotary, rope_cos_sin, rope_frequencies, rope_phase

from conftest import random_ids
from tolerances import ROUNDING_FLOOR


def test_a_dtype_conversion_keeps_the_rotary_tables(tiny_cfg, gen):
    model = DSFlashModel(tiny_cfg).init_weights(seed=2).eval()
    ids = random_ids(gen, 1, 11, tiny_cfg.vocab_size)
    with torch.no_grad():
        before = model(ids)
        assert torch.equal(model.to(torch.float32)(ids), before)  # a no-op conversion stays one
    pos = torch.tensor([3, 4095, 131071])
    fp32_tables = [r.cos_sin(pos) for r in model.modules() if isinstance(r, Rotary)]
    model.to(torch.bfloat16)
    rotaries = [r for r in model.modules() if isinstance(r, Rotary)]
    assert rotaries and all(r.phase.dtype == torch.float32 for r in rotaries)
    for r in rotaries:
        assert r.freqs.dtype == torch.float64
        assert torch.equal(r.phase, rope_phase(rope_frequencies(*r._args)))
    # the bf16 model's angles are the fp32 model's, to the last bit, at 128K positions too
    for r, (cos, sin) in zip(rotaries, fp32_tables):
        got_cos, got_sin = r.cos_sin(pos)
        assert torch.equal(got_cos, cos) and torch.equal(got_sin, sin)


def flash_frequencies() -> list[torch.Tensor]:
    """The flash preset's two frequency sets: plain theta, and compress theta with YaRN."""
    cfg = ModelConfig.preset("flash")
    return [rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, None),
            rope_frequencies(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)]


def test_cos_sin_match_the_fp64_angles_at_every_position_range(gen):
    pos = torch.cat([torch.arange(0, 4096), torch.randint(0, POSITION_LIMIT, (200_000,), generator=gen),
                     torch.arange(POSITION_LIMIT - 4096, POSITION_LIMIT),
                     torch.tensor([65535, 65536, 65537, 1 << 20]), -torch.arange(1, 1000)])
    for freqs in flash_frequencies():
        cos, sin = rope_cos_sin(pos, rope_phase(freqs))
        assert cos.dtype == sin.dtype == torch.float32
        angles = pos.to(torch.float64).unsqueeze(-1) * freqs
        err = max((cos.double() - angles.cos()).abs().max().item(),
                  (sin.double() - angles.sin()).abs().max().item())
        assert err <= ROUNDING_FLOOR[torch.float32], err


@pytest.mark.parametrize("pos", [0, 255, 256, 65535, 65536, POSITION_LIMIT - 1, -1, -65537])
def test_digit_boundaries(pos):
    freqs = flash_frequencies()[1]
    cos, sin = rope_cos_sin(torch.tensor([pos]), rope_phase(freqs))
    angles = pos * freqs
    assert (cos[0].double() - angles.cos()).abs().max().item() <= ROUNDING_FLOOR[torch.float32]
    assert (sin[0].double() - angles.sin()).abs().max().item() <= ROUNDING_FLOOR[torch.float32]


@pytest.mark.parametrize("ratios", [None, (0, 2, 2, 2, 2, 2, 2, 2)])
def test_a_step_forms_each_table_once(tiny_cfg, gen, monkeypatch, ratios):
    # every layer of a kind rotates the step's rows: one table per frequency set, plus one per
    # compress ratio of the Full layers' published entries (their group positions)
    cfg = tiny_cfg if ratios is None else tiny_cfg.replace(compress_ratios=ratios)
    model = DSFlashModel(cfg).init_weights(seed=2).eval()
    calls = []
    original = Rotary.cos_sin
    monkeypatch.setattr(Rotary, "cos_sin", lambda self, pos: calls.append(self.key) or original(self, pos))
    with torch.no_grad():
        model(random_ids(gen, 2, 5, cfg.vocab_size))
    rotaries = [layer.attn.rotary for layer in model.layers]
    full = [i for i, role in enumerate(cfg.layer_roles) if role == "full"]
    published = {cfg.compress_ratios[i] for i in full}
    assert len({r.key for r in rotaries}) == 2  # plain theta, and compress theta with YaRN
    assert len(full) == 2 and len(calls) == 2 + len(published)


def test_a_reused_trace_forms_the_tables_of_each_call(tiny_cfg, gen):
    # StepShared keeps one step's tables; a trace passed to two calls must not hand the first
    # call's positions to the second
    from dsflash.model.attention import StepShared

    model = DSFlashModel(tiny_cfg).init_weights(seed=2).eval()
    trace = StepShared()
    with torch.no_grad():
        for length in (5, 9):
            ids = random_ids(gen, 1, length, tiny_cfg.vocab_size)
            assert torch.equal(model(ids, trace=trace), model(ids))
