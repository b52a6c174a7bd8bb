import pytest
import torch

from dsflash.model.cache import ModelCache
from dsflash.model.config import ModelConfig
from dsflash.model.model import DSFlashModel
from dsflash.model.quant import (
    E2M1_GRID,
    E2M1_MIDS,
    ceil_log2,
    e4m3_code,
    floor_log2,
    fp4_e4m3scale_pack,
    fp4_e4m3scale_qat,
    fp4_pow2_pack,
    fp4_pow2_qat,
    fp8_e4m3_qat,
    pow2,
    round_e2m1,
    round_e4m3,
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


def hard_values(gen) -> torch.Tensor:
    """fp32 values where exponent and rounding code go wrong: powers of two and their fp32
    neighbours over the whole normal range, e4m3 values and the mid-points between them, e2m1
    mid-points, zeros of both signs, and random values of log-uniform magnitude."""
    powers = torch.tensor([2.0**k for k in range(-126, 128)])
    near = torch.cat([powers, torch.nextafter(powers, torch.zeros(())),
                      torch.nextafter(powers, torch.full((), float("inf")))])
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e4m3_mids = (e4m3[1:] + e4m3[:-1]) / 2
    mids = torch.tensor(E2M1_MIDS)
    scaled_mids = torch.cat([mids * 2.0**k for k in range(-8, 9)])
    rand = torch.exp2(torch.rand(20000, generator=gen) * 140 - 130) * torch.randn(20000, generator=gen).sign()
    v = torch.cat([near, e4m3, e4m3_mids, torch.nextafter(e4m3_mids, torch.zeros(())), scaled_mids,
                   torch.tensor([0.0, -0.0, 6.0, 448.0, 1e-4 / 448]), rand])
    return torch.cat([v, -v])


@pytest.fixture(params=["eager", "export"])
def form(request, monkeypatch):
    """Both forms of the exponent helpers: eager (frexp, bit patterns) and the one the ONNX
    export traces (log2 guess settled by exact powers, powers gathered from a table)."""
    if request.param == "export":
        monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    return request.param


def test_powers_of_two_are_exact_over_the_whole_range(form):
    e = torch.arange(-126, 129)
    assert torch.equal(pow2(e, -126, 128), torch.ldexp(torch.ones(255), e.int()))
    assert torch.equal(pow2(torch.tensor([[-9, 5]]), -9, 5), torch.tensor([[2.0**-9, 32.0]]))
    e = torch.arange(-128, 128)  # the FP4 keys' int8 exponents (unpack_keys_fp4): subnormals too
    assert torch.equal(pow2(e, -128, 127), torch.ldexp(torch.ones(256), e.int()))
    with pytest.raises(ValueError, match=r"exponent range \[-150, 0\] must lie within \[-149, 128\]"):
        pow2(e, -150, 0)


def test_exponents_equal_frexp(gen, form):
    v = hard_values(gen).abs()
    v = v[v >= 2.0**-126]
    mant, exp = torch.frexp(v)
    assert torch.equal(floor_log2(v, -126, 127), (exp - 1).long())
    assert torch.equal(ceil_log2(v), torch.where(mant == 0.5, exp - 1, exp).long())
    small = torch.tensor([0.0, 2.0**-130, 2.0**-7, 2.0**-6, 500.0, 1e30])
    assert floor_log2(small, -6, 8).tolist() == [-6, -6, -6, -6, 8, 8]  # clamped to the range


def test_e4m3_rounding_equals_the_float8_cast(gen, form):
    v = hard_values(gen)
    v = v[v.abs() <= 448]
    assert torch.equal(round_e4m3(v), v.to(torch.float8_e4m3fn).float())
    assert round_e4m3(torch.tensor([1e6, -1e6])).tolist() == [448.0, -448.0]  # saturates


def test_e2m1_rounding_equals_bucketize(gen, form):
    v = hard_values(gen).clamp(-6, 6)
    grid = torch.tensor(E2M1_GRID)
    mids = torch.tensor(E2M1_MIDS)
    code = torch.bucketize(v.abs(), mids)
    code = code + (torch.isin(v.abs(), mids) & (code % 2 == 1)).long()
    assert torch.equal(round_e2m1(v), torch.copysign(grid[code], v))


def test_pack_codes_and_exponents(gen):
    x = torch.randn(5, 7, 64, generator=gen)
    x = x * torch.exp2(torch.randint(-20, 20, (5, 7, 1), generator=gen).float())
    x[0, 0, :32] = 0.0   # an all-zero block: the smallest scale
    x[0, 1, :5] = -0.0
    codes, exps = fp4_pow2_pack(x)
    assert codes.dtype == torch.uint8 and exps.dtype == torch.int8 and exps.shape == (5, 7, 2)
    nib = torch.stack([codes & 15, codes >> 4], -1).flatten(-2).long()
    grid = torch.tensor(E2M1_GRID)
    value = torch.where(nib >= 8, -grid[nib & 7], grid[nib & 7])
    scale = torch.exp2(exps.float()).repeat_interleave(32, -1)
    assert torch.equal(value * scale, fp4_pow2_qat(x))
    assert not ((nib == 8).any())  # zeros pack as +0
    assert exps[0, 0, 0] == -126


def test_exported_powers_of_two_are_one_gather_and_exact():
    """The export form is one Gather from a table (a product per exponent bit, the form before,
    put 7 nodes per bit into every round-trip: 19,269 nodes in a tiny kv_qat decode step against
    13,910), and ONNX Runtime gives every power of fp32's range exactly, subnormals and inf too."""
    ort = pytest.importorskip("onnxruntime")

    class Powers(torch.nn.Module):
        def forward(self, e):
            return pow2(e, -149, 128)

    program = torch.onnx.export(Powers(), (torch.arange(-149, 129),), dynamo=True, optimize=False,
                                verbose=False, dynamic_shapes=({0: torch.export.Dim.AUTO},))
    ops = [n.op_type for n in program.model_proto.graph.node]
    assert ops.count("Gather") == 1 and "Where" not in ops and "Floor" not in ops, ops
    e = torch.arange(-149, 129).flip(0)
    session = ort.InferenceSession(program.model_proto.SerializeToString())
    got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: e.numpy()})[0])
    want = torch.ldexp(torch.ones(e.shape, dtype=torch.float64), e).float()  # 2^128 -> inf
    assert torch.equal(got, want) and torch.isinf(got[0]) and got[-1] == 2.0**-149


@pytest.mark.parametrize("fn", [fp8_e4m3_qat, fp4_pow2_qat, fp4_e4m3scale_qat, fp4_pow2_pack,
                                fp4_e4m3scale_pack])
def test_round_trips_export_to_onnx_bit_for_bit(fn, gen, tmp_path):
    """kv_qat models export: each round-trip runs in ONNX Runtime exactly as in PyTorch."""
    ort = pytest.importorskip("onnxruntime")

    class Quantise(torch.nn.Module):
        def forward(self, x):
            return fn(x)

    x = hard_values(gen)[:64 * 300].reshape(300, 64).clamp(-1e30, 1e30)
    x = torch.cat([x, torch.randn(40, 64, generator=gen) * 3])
    program = torch.onnx.export(Quantise(), (x,), dynamo=True, optimize=False, verbose=False,
                                dynamic_shapes=({0: torch.export.Dim.AUTO},))
    session = ort.InferenceSession(program.model_proto.SerializeToString())
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    want = fn(x)
    for g, w in zip(got, want if isinstance(want, tuple) else (want,)):
        assert torch.equal(torch.from_numpy(g), w)


def test_packed_index_keys_score_as_their_values(gen):
    """kv_qat caches keep index keys packed (model/cache.py): scoring the codes and exponents gives
    the scores of the round-tripped values, bit for bit (the values are grid points times powers
    of two, exact in any float dtype)."""
    from dsflash.plugins.csa2_index_score import reference

    q = fp4_pow2_qat(torch.randn(2, 3, 4, 64, generator=gen))
    w = torch.randn(2, 3, 4, generator=gen)
    k = torch.randn(2, 9, 64, generator=gen) * 3
    visible = torch.rand(2, 3, 9, generator=gen) > 0.2
    packed = reference.csa2_index_score_fp4(q, w, *fp4_pow2_pack(k), visible)
    assert torch.equal(packed, reference.csa2_index_score(q, w, fp4_pow2_qat(k), visible))


def test_kv_qat_cache_holds_index_keys_and_entries_in_fp4():
    cfg = ModelConfig.preset("tiny").replace(kv_qat=True, index_head_dim=64)
    cache = ModelCache.allocate(cfg, 2, 32)
    for src in cfg.kv_source_layer_ids:
        codes, exps = cache.tensors[f"index_k.{src}"], cache.tensors[f"index_e.{src}"]
        assert codes.dtype == torch.uint8 and codes.shape[-1] == 32
        assert exps.dtype == torch.int8 and exps.shape[-1] == 2
        entries, scales = cache.tensors[f"kv.{src}"], cache.tensors[f"kv_scale.{src}"]
        assert entries.dtype == scales.dtype == torch.uint8
        assert entries.shape[-1] == cfg.head_dim // 2 and scales.shape[-1] == cfg.head_dim // 16
        assert codes.shape[:2] == exps.shape[:2] == entries.shape[:2] == scales.shape[:2]
    plain = ModelCache.allocate(cfg.replace(kv_qat=False), 2, 32)
    assert "index_e.1" not in plain.tensors and plain.tensors["index_k.1"].shape[-1] == 64
    assert "kv_scale.1" not in plain.tensors and plain.tensors["kv.1"].shape[-1] == cfg.head_dim


def test_e4m3_bits_equal_the_float8_cast(form):
    """The entries' scales as stored: e4m3_code (packing) and e4m3_value (unpacking) against
    torch's float8_e4m3fn bits over every non-negative finite e4m3 value, subnormals included."""
    from dsflash.plugins.dtypes import e4m3_value

    bits = torch.arange(0, 127, dtype=torch.uint8)
    values = bits.view(torch.float8_e4m3fn).float()
    assert torch.equal(e4m3_value(bits), values)
    assert torch.equal(e4m3_code(values), bits.long())


def test_pack_entries_codes_and_scales(gen, form):
    """fp4_e4m3scale_pack: the entries' codes and e4m3 scale bits unpack to fp4_e4m3scale_qat's
    values exactly, over blocks of every scale from the smallest (an all-zero block) to 448."""
    from dsflash.plugins.csa2_sparse_attention.reference import unpack_entries_fp4

    x = torch.randn(5, 9, 64, generator=gen)
    block_scale = torch.exp2(torch.randint(-14, 12, (5, 9, 4, 1), generator=gen).float())
    x = x * block_scale.expand(5, 9, 4, 16).flatten(-2)
    x[0, 0, :16] = 0.0
    x[0, 1, :16] = 1e6
    codes, scales = fp4_e4m3scale_pack(x)
    assert codes.dtype == scales.dtype == torch.uint8 and scales.shape == (5, 9, 4)
    assert scales[0, 0, 0] == 1 and scales[0, 1, 0] == 126  # 2^-9 and the 448 it saturates to
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(unpack_entries_fp4(codes, scales, dtype), fp4_e4m3scale_qat(x).to(dtype))


def test_e2m1_magnitudes_by_arithmetic_equal_the_grid():
    from dsflash.plugins.dtypes import e2m1_magnitude

    codes = torch.arange(16)
    assert e2m1_magnitude(codes).tolist() == list(E2M1_GRID) * 2
