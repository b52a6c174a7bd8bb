"""Every Triton kernel against its reference by the tolerance rule (tests/kernel_checks.py) on
small irregular shapes: lengths crossing the kernels' block sizes, odd head counts, rows with
nothing visible. On a machine without CUDA the kernels run in the Triton interpreter (conftest
sets TRITON_INTERPRET=1), which is how CI covers them; on the GPU the same tests run for real.
"""

from __future__ import annotations

import re

import pytest
import torch
from kernel_checks import DEVICE, assert_kernel_matches, on_device

from dsflash.plugins.launch import interpreting

triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
import triton.language as tl  # noqa: E402

from dsflash.model.quant import fp4_pow2_pack  # noqa: E402
from dsflash.plugins.csa2_index_score import kernel as index_kernel  # noqa: E402
from dsflash.plugins.csa2_index_score import reference as index_ref  # noqa: E402
from dsflash.plugins.csa2_sparse_attention import kernel as attn_kernel  # noqa: E402
from dsflash.plugins.csa2_sparse_attention import reference as attn_ref  # noqa: E402
from dsflash.plugins.csa2_sparse_attention import splits as attn_splits  # noqa: E402
from dsflash.plugins.engram_hash_gather import kernel as engram_kernel  # noqa: E402
from dsflash.plugins.engram_hash_gather import reference as engram_ref  # noqa: E402
from dsflash.plugins.launch import next_pow2  # noqa: E402
from dsflash.plugins.mhc_boundary import kernel as mhc_kernel  # noqa: E402
from dsflash.plugins.mhc_boundary import reference as mhc_ref  # noqa: E402
from dsflash.plugins.stable_topk.reference import block_maxima  # noqa: E402

# The interpreter computes in numpy (no bf16 arithmetic): check fp32 there, bf16 on the GPU too.
DTYPES = [torch.float32] if interpreting() else [torch.float32, torch.bfloat16]


def engram_case(gen, batch, new, look, heads, dim):
    primes = [int(p) for p in torch.randint(50, 400, (look * heads,), generator=gen)]
    offsets = [sum(primes[:i]) for i in range(len(primes))]
    mult = [int(m) * 2 + 1 for m in torch.randint(1, 2**20, (look + 1,), generator=gen)]
    cids = torch.randint(0, 1000, (batch, look + new), generator=gen)
    cids[0, : look + 1] = -1  # positions before the start block every n-gram over them
    cids[-1, look + new // 2] = -1  # a dead token mid-sequence
    return cids, sum(primes), mult, primes, offsets


@pytest.mark.parametrize("batch,new,look,heads,dim",
                         [(2, 11, 3, 3, 20), (1, 1, 2, 8, 130), (3, 37, 1, 5, 16)])
def test_engram_gather_kernel_is_exact(gen, batch, new, look, heads, dim):
    cids, rows, mult, primes, offsets = engram_case(gen, batch, new, look, heads, dim)
    table = torch.randn(rows, dim, generator=gen)
    args = (cids, table, mult, primes, offsets, 7, heads)
    got = engram_kernel.engram_hash_gather(*on_device(*args))
    assert torch.equal(got.cpu(), engram_ref.engram_hash_gather(*args))  # a gather: bit-exact


def test_engram_gather_kernel_rejects_bad_input(gen):
    cids, rows, mult, primes, offsets = engram_case(gen, 1, 4, 2, 2, 8)
    small = torch.randn(rows - 1, 8, generator=gen)
    with pytest.raises(ValueError, match=f"table has {rows - 1} rows"):
        engram_kernel.engram_hash_gather(*on_device(cids, small), mult, primes, offsets, 7, 2)
    with pytest.raises(ValueError, match="cids has dtype torch.int32"):
        engram_kernel.engram_hash_gather(*on_device(cids.int(), small), mult, primes, offsets, 7, 2)
    with pytest.raises(ValueError, match="look \\* heads = 4"):
        engram_kernel.engram_hash_gather(*on_device(cids, small), mult, primes[:3], offsets[:3], 7, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,i,j,n", [(2, 3, 3, 20, 70), (1, 1, 17, 16, 130), (2, 5, 2, 33, 5)])
def test_index_score_kernel(gen, dtype, b, s, i, j, n):
    q = torch.randn(b, s, i, j, generator=gen).to(dtype)
    w = torch.randn(b, s, i, generator=gen)
    k = torch.randn(b, n, j, generator=gen).to(dtype)
    visible = torch.rand(b, s, n, generator=gen) > 0.3
    visible[0, 0] = False  # a row that sees nothing
    visible[-1, -1, : min(n, 64)] = False  # a whole key block skipped
    args = (q, w, k, visible)
    got = index_kernel.csa2_index_score(*on_device(*args))
    assert_kernel_matches(got, index_ref.csa2_index_score, args, {}, dtype, "Csa2IndexScore")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,i,j,n,p,over", [
    (2, 3, 3, 20, 150, 70, {}),
    (1, 2, 40, 16, 100, 37, {"BLOCK_I": 16}),  # 3 head groups
    (2, 1, 5, 33, 90, 100, {"BLOCKS": 3, "STAGES": 2, "BLOCK_N": 16})])  # pipelined, past P
def test_index_score_pooled_kernel(gen, dtype, b, s, i, j, n, p, over):
    """Scores of a listed pool: ascending runs of ids, -1 padding, ids past N (-inf, keys unread),
    a row listing nothing."""
    from dsflash.plugins.csa2_index_score import pooled as pooled_kernel

    q = torch.randn(b, s, i, j, generator=gen).to(dtype)
    w = torch.randn(b, s, i, generator=gen)
    k = torch.randn(b, n, j, generator=gen).to(dtype)
    entries = torch.randint(0, n, (b, s, p), generator=gen).sort(dim=-1).values.int()
    entries[0, -1, p // 2:] = -1
    entries[-1, 0, :3] = torch.tensor([n, n + 7, -5])
    entries[0, 0] = -1
    args = (q, w, k, entries)
    got = pooled_kernel.csa2_index_score_pooled(*on_device(*args), overrides=over)
    assert_kernel_matches(got, index_ref.csa2_index_score_pooled, args, {}, dtype, "Csa2IndexScore(pooled)")
    got64 = pooled_kernel.csa2_index_score_pooled(*on_device(q, w, k, entries.long()), overrides=over)
    assert torch.equal(got64, got)
    with pytest.raises(ValueError, match="entries has dtype torch.int16"):
        pooled_kernel.csa2_index_score_pooled(*on_device(q, w, k, entries.short()))
    with pytest.raises(ValueError, match="entries has shape"):
        pooled_kernel.csa2_index_score_pooled(*on_device(q, w, k, entries[:, :, None]))


@pytest.mark.parametrize("block,over", [(8, {}), (2, {"BLOCKS": 3, "STAGES": 2, "BLOCK_N": 16}),
                                         (16, {"BLOCK_N": 16})])
def test_index_score_pooled_kernel_writes_its_block_maxima(gen, block, over):
    """The maxima the listed index launch writes beside its scores (for the block-max top-k) are
    bit for bit those of the scores it stored: runs of `block` slots, clamped, the last run past P
    padded; a row listing nothing gives -float32 max. Launch settings whose BLOCK_N the run does not
    divide are refused, naming both."""
    from dsflash.plugins.csa2_index_score import pooled as pooled_kernel

    b, s, i, j, n, p = 2, 3, 3, 20, 150, 75
    q, w = torch.randn(b, s, i, j, generator=gen), torch.randn(b, s, i, generator=gen)
    k = torch.randn(b, n, j, generator=gen)
    entries = torch.randint(0, n, (b, s, p), generator=gen).sort(dim=-1).values.int()
    entries[0, 0] = -1
    entries[1, 2, 40:] = -1
    args = (q, w, k, entries)
    scores, maxima = pooled_kernel.csa2_index_score_pooled_maxima(*on_device(*args), block, overrides=over)
    assert maxima.shape == (b, s, -(-p // block))
    assert torch.equal(scores, pooled_kernel.csa2_index_score_pooled(*on_device(*args), overrides=over))
    assert_kernel_matches(scores, index_ref.csa2_index_score_pooled, args, {}, torch.float32,
                          "Csa2IndexScore(pooled)")
    assert torch.equal(maxima, block_maxima(scores, block))
    assert (maxima[0, 0] == -torch.finfo(torch.float32).max).all()
    # the reference's maxima by hand: +-inf clamped to +-float32 max, the last run padded
    big = torch.finfo(torch.float32).max
    row = torch.tensor([[1.0, float("-inf"), 3.0, 2.0, float("inf")]])
    assert block_maxima(row, 2).tolist() == [[1.0, 3.0, big]]
    assert block_maxima(torch.full((1, 3), float("-inf")), 2).tolist() == [[-big, -big]]
    ref_scores, ref_maxima = index_ref.csa2_index_score_pooled_maxima(*args, block)
    assert ref_maxima.shape == maxima.shape
    assert torch.equal(ref_scores, index_ref.csa2_index_score_pooled(*args))
    with pytest.raises(ValueError, match="runs of 32 slots.*BLOCK_N 16"):
        pooled_kernel.csa2_index_score_pooled_maxima(*on_device(*args), 32, overrides={"BLOCK_N": 16})
    with pytest.raises(ValueError, match="runs of 3 slots"):
        pooled_kernel.csa2_index_score_pooled_maxima(*on_device(*args), 3)


@pytest.mark.parametrize("over", [{}, {"STAGES": 2, "BLOCKS": 3, "BLOCK_N": 32}, {"EXP_WORDS": False}],
                         ids=["branch", "pipelined", "exponent_bytes"])
@pytest.mark.parametrize("b,s,i,j,n,p", [(2, 3, 16, 128, 150, 140), (1, 2, 32, 96, 90, 37)])
def test_index_score_fp4_pooled_kernel(gen, b, s, i, j, n, p, over):
    """Scores of a listed pool over FP4 keys (pooled_fp4.py: the FP8 tensor-core products of a
    listed entry's key). Queries with 8 significant bits within 2^8 of their head's largest, so
    the interpreter's exact FP8 products meet the fp32 bound (as the mask form's test); ids as in
    the bf16 pooled test: -1 padding, ids past N, a row listing nothing, a block of padding."""
    from dsflash.plugins.csa2_index_score import pooled_fp4

    dtype = torch.float32 if interpreting() else torch.bfloat16
    mag = torch.randint(1, 256, (b, s, i, j), generator=gen) / 64.0
    q = (mag * torch.where(torch.rand(b, s, i, j, generator=gen) < 0.5, -1.0, 1.0)).to(dtype)
    w = torch.randn(b, s, i, generator=gen)
    codes, exps = fp4_pow2_pack(torch.randn(b, n, j, generator=gen) * torch.logspace(-4, 4, n).view(1, n, 1))
    entries = torch.randint(0, n, (b, s, p), generator=gen).sort(dim=-1).values.int()
    entries[0, -1, p // 3:] = -1
    entries[-1, 0, :3] = torch.tensor([n, n + 7, -5])
    entries[0, 0] = -1
    args = (q, w, codes, exps, entries)
    got = pooled_fp4.csa2_index_score_fp4_pooled(*on_device(*args), overrides=over)
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4_pooled, args, {}, dtype,
                          f"Csa2IndexScore(fp4, pooled, {over})")
    assert torch.equal(pooled_fp4.csa2_index_score_fp4_pooled(*on_device(q, w, codes, exps, entries.long()),
                                                              overrides=over), got)
    # with the block maxima the top-k takes from it: the same scores, and their maxima bit for bit
    scores, maxima = pooled_fp4.csa2_index_score_fp4_pooled_maxima(*on_device(*args), 8, overrides=over)
    assert torch.equal(scores, got) and torch.equal(maxima, block_maxima(got, 8))
    with pytest.raises(ValueError, match="power-of-two head count >= 16, got 12"):
        pooled_fp4.csa2_index_score_fp4_pooled(*on_device(q[:, :, :12], w[:, :, :12], codes, exps, entries))
    other = torch.float64 if interpreting() else torch.float32
    with pytest.raises(ValueError, match=f"q has dtype {other}"):
        pooled_fp4.csa2_index_score_fp4_pooled(*on_device(q.to(other), w, codes, exps, entries))
    with pytest.raises(ValueError, match="entries has shape"):
        pooled_fp4.csa2_index_score_fp4_pooled(*on_device(q, w, codes, exps, entries[:, :1]))


def test_pooled_fp4_launch_rule(monkeypatch):
    """One row of a 16K-slot pool: the branch launch; from a program per SM the pipelined loop,
    under a 128-register cap (4 programs fit an SM, not 3), in the runs the wave estimate rates
    fastest: on 132 SMs the fastest of the H100 sweep in pooled_fp4_config's docstring at each of
    its row counts (runs of 4 at 8-16 rows, 8 at 24-32 and 96, 16 at 48-64 and 128); on the CPU
    the branch launch."""
    from types import SimpleNamespace

    from dsflash.plugins.csa2_index_score.pooled_fp4 import pooled_fp4_config

    assert pooled_fp4_config(64, 16384, torch.device("cpu"))["STAGES"] == 0
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(multi_processor_count=132))
    swept = (8, 16, 24, 32, 48, 64, 96, 128)
    runs = {rows: pooled_fp4_config(rows, 16384, torch.device("cuda")) for rows in (1, *swept)}
    assert runs[1] == {"BLOCK_N": 64, "BLOCKS": 4, "STAGES": 0, "num_warps": 4}
    assert {(runs[r]["BLOCK_N"], runs[r]["STAGES"], runs[r]["maxnreg"]) for r in swept} == {(128, 3, 128)}
    assert [runs[r]["BLOCKS"] for r in swept] == [4, 4, 8, 8, 16, 16, 8, 16]


@pytest.mark.parametrize("n,size,chunk", [(300, 200, 64), (300, 40, 128), (5, 9, 16), (1000, 1000, 256),
                                          (70, 600, 16)])
def test_pool_entry_list_kernel_is_exact(gen, n, size, chunk):
    """The listing kernels against model/csa2_ops.py:pool_entry_list bit for bit: rows of several
    segments, a list shorter than the members (the rest dropped), lists longer than the row (the
    tail padded by every segment's program), an empty row and a full one."""
    from dsflash.model import csa2_ops
    from dsflash.plugins.csa2_index_score import pool_list

    member = torch.rand(2, 3, n, generator=gen) > 0.6
    member[0, 0] = False
    member[1, 2] = True
    got = pool_list.pool_entry_list(*on_device(member), size, overrides={"SEG": chunk})
    assert torch.equal(got.cpu(), csa2_ops.pool_entry_list(member, size))


def test_listed_picks_kernel_is_exact(gen):
    """Mapping a top-k over the list back to entry ids: -inf picks, positions outside the list
    (unread, -1) and columns past the top-k's are -1, as in the reference."""
    from dsflash.model import csa2_ops
    from dsflash.plugins.csa2_index_score import pool_list

    entries = torch.randint(-1, 5000, (2, 3, 70), generator=gen, dtype=torch.int32)
    vals = torch.randn(2, 3, 37, generator=gen)
    vals[0, 1, 30:] = float("-inf")
    pos = torch.randint(0, 70, (2, 3, 37), generator=gen)
    pos[1, 0, :2] = torch.tensor([-3, 70])
    for width in (37, 50):
        got = pool_list.listed_picks(*on_device(vals, pos, entries), width)
        assert torch.equal(got.cpu(), csa2_ops.listed_picks(vals, pos, entries, width))
    with pytest.raises(ValueError, match="width 36 < the top-k's 37"):
        pool_list.listed_picks(*on_device(vals, pos, entries), 36)
    with pytest.raises(ValueError, match="member has dtype torch.uint8"):
        pool_list.pool_entry_list(*on_device((entries > 0).to(torch.uint8)), 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,i,j,n,over", [
    (2, 3, 3, 20, 150, {"BLOCKS": 3, "STAGES": 2, "BLOCK_N": 16}),  # the last program's blocks run past N
    (1, 2, 40, 16, 100, {"BLOCKS": 2, "STAGES": 3, "BLOCK_N": 16, "BLOCK_I": 16})])  # 3 head groups
def test_index_score_kernel_pipelined(gen, dtype, b, s, i, j, n, over):
    """Several key blocks per program in a software-pipelined loop (BLOCKS > 1): the same scores,
    invisible entries and whole invisible blocks included."""
    q = torch.randn(b, s, i, j, generator=gen).to(dtype)
    w = torch.randn(b, s, i, generator=gen)
    k = torch.randn(b, n, j, generator=gen).to(dtype)
    visible = torch.rand(b, s, n, generator=gen) > 0.3
    visible[0, 0] = False
    visible[-1, -1, 16:48] = False
    args = (q, w, k, visible)
    got = index_kernel.csa2_index_score(*on_device(*args), overrides=over)
    assert_kernel_matches(got, index_ref.csa2_index_score, args, {}, dtype, "Csa2IndexScore(pipelined)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,i,j,n", [(2, 3, 3, 32, 70), (1, 1, 17, 128, 130), (1, 2, 5, 96, 40)])
def test_index_score_fp4_kernel(gen, dtype, b, s, i, j, n):
    """FP4 keys as stored (model/quant.py:fp4_pow2_pack): unpacking equals the model's QAT
    round-trip bit for bit, and the kernel matches the reference over the unpacked keys."""
    from dsflash.model.quant import fp4_pow2_pack, fp4_pow2_qat

    q = torch.randn(b, s, i, j, generator=gen).to(dtype)
    w = torch.randn(b, s, i, generator=gen)
    k = torch.randn(b, n, j, generator=gen) * torch.logspace(-4, 4, n).view(1, n, 1)
    k[0, 0, :32] = 0  # an all-zero block: the smallest scale
    codes, exps = fp4_pow2_pack(k)
    assert torch.equal(index_ref.unpack_keys_fp4(codes, exps, torch.float32), fp4_pow2_qat(k))
    visible = torch.rand(b, s, n, generator=gen) > 0.3
    visible[-1, -1, : min(n, 64)] = False
    args = (q, w, codes, exps, visible)
    got = index_kernel.csa2_index_score_fp4(*on_device(*args))
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4, args, {}, dtype, "Csa2IndexScore(fp4)")
    with pytest.raises(ValueError, match="exps has dtype"):
        index_kernel.csa2_index_score_fp4(*on_device(q, w, codes, exps.int(), visible))


@pytest.mark.parametrize("over", [{}, {"STAGES": 2, "BLOCKS": 3}, {"EXP_WORDS": False, "BLOCK_N": 32}],
                         ids=["branch", "pipelined", "exponent_bytes"])
@pytest.mark.parametrize("b,s,i,j,n", [(2, 3, 16, 32, 70), (1, 2, 32, 128, 300), (1, 1, 16, 96, 40)])
def test_index_score_fp4_tensor_core_path(gen, b, s, i, j, n, over):
    """The FP8 tensor-core path (fp4_mma.py: keys as e4m3 bytes, queries as two e4m3 parts per
    head scale). Queries here have 8 significant bits within 2^8 of their head's largest, so the
    split is exact: the interpreter's exact FP8 products must then meet the fp32 bound, which
    checks the decode, the channel order, the scales and the split. The GPU runs it in bf16 on
    random queries (bf16 bound). Variants: the branch that skips unseen blocks, the pipelined loop
    (visibility masks the loads; BLOCKS 3 leaves a short last run), one exponent byte per load."""
    dtype = torch.float32 if interpreting() else torch.bfloat16
    mag = torch.randint(1, 256, (b, s, i, j), generator=gen) / 64.0
    q = (mag * torch.where(torch.rand(b, s, i, j, generator=gen) < 0.5, -1.0, 1.0)).to(dtype)
    w = torch.randn(b, s, i, generator=gen)
    k = torch.randn(b, n, j, generator=gen) * torch.logspace(-4, 4, n).view(1, n, 1)
    codes, exps = fp4_pow2_pack(k)
    visible = torch.rand(b, s, n, generator=gen) > 0.3
    visible[-1, -1, : min(n, 128)] = False  # a whole entry block skipped
    args = (q, w, codes, exps, visible)
    got = index_kernel.csa2_index_score_fp4(*on_device(*args), overrides={"PATH": "mma"} | over)
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4, args, {}, dtype,
                          f"Csa2IndexScore(fp4, FP8, {over})")
    if j % 128:
        with pytest.raises(ValueError, match=f"EXP_WORDS needs J / 32 = {j // 32} exponents"):
            index_kernel.csa2_index_score_fp4(*on_device(*args), overrides={"PATH": "mma", "EXP_WORDS": True})
    with pytest.raises(ValueError, match="power-of-two head count >= 16, got 12"):
        index_kernel.csa2_index_score_fp4(*on_device(q[:, :, :12], w[:, :, :12], codes, exps, visible),
                                          overrides={"PATH": "mma"})
    with pytest.raises(ValueError, match="PATH 'fp8' is not one of"):
        index_kernel.csa2_index_score_fp4(*on_device(*args), overrides={"PATH": "fp8"})


@pytest.mark.parametrize("path", ["decode", "mma"])
def test_index_score_fp4_extreme_scales(gen, path):
    """Any int8 exponent decodes exactly as the reference does: below -126 (never packed, still
    valid int8) the reference's subnormal keys, and large ones (exact sums of equal keys here, so
    the check is bit for bit; random keys at such scales make the dot ill-conditioned, and the
    tolerance rule would then judge summation order rather than the decode)."""
    q = torch.ones(1, 1, 16, 32)
    w = torch.ones(1, 1, 16)
    codes = torch.full((1, 6, 16), 0x22, dtype=torch.uint8)  # every channel 1.0
    exps = torch.tensor([[[-128], [-127], [-126], [0], [60], [100]]], dtype=torch.int8)
    visible = torch.ones(1, 1, 6, dtype=torch.bool)
    want = index_ref.csa2_index_score_fp4(q, w, codes, exps, visible)
    got = index_kernel.csa2_index_score_fp4(*on_device(q, w, codes, exps, visible), overrides={"PATH": path})
    assert torch.all(want > 0) and torch.equal(got.cpu(), want)


def _fp4_keys_of_every_exponent(gen, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 keys [1, n, 128] of every channel 1.0 whose four scale groups' exponents lie within 12
    binades of each other (every sum of the test is then exact in fp32, so the scores compare bit
    for bit), from -126 to 100 per entry, and one entry in 40 holding -127 or -128 (below what
    fp4_pow2_pack writes: the fp32 subnormals 2^-127 and 2^-128) in one of its groups."""
    base = torch.randint(-126, 89, (1, n, 1), generator=gen)
    exps = base + torch.randint(0, 13, (1, n, 4), generator=gen)
    odd = torch.arange(n) % 40 == 7
    group = torch.randint(0, 4, (n,), generator=gen)
    low = torch.randint(-128, -114, (1, n, 4), generator=gen)
    low[0, torch.arange(n), group] = torch.where(torch.arange(n) % 80 == 7, -128, -127)
    exps = torch.where(odd.view(1, n, 1), low, exps).to(torch.int8)
    return torch.full((1, n, 64), 0x22, dtype=torch.uint8), exps


FP4_WORD_LAUNCHES = {"mma": {"PATH": "mma", "EXP_WORDS": True},
                     "mma_pipelined": {"PATH": "mma", "EXP_WORDS": True, "BLOCK_N": 128, "BLOCKS": 4,
                                       "STAGES": 3}}


@pytest.mark.parametrize("launch", ["mma", "mma_pipelined", "listed", "listed_pipelined"])
def test_index_score_fp4_word_exponents_exact_at_every_int8(gen, launch):
    """The FP8 paths with the exponents as int32 words (four per word, fp4_mma.py:_exponent), at
    every int8 exponent: with the queries 2^g in scale group g (so that a group given another's
    scale shows), the scores equal the reference's bit for bit at exponents from -128 to 100, the
    subnormal scales 2^-127 and 2^-128 in one entry in 40. Mask form (one-row and pipelined
    launches) and listed form (branch and pipelined); test_index_score_fp4_extreme_scales covers
    the byte exponents (J = 32). Under the interpreter the queries are fp32."""
    from dsflash.plugins.csa2_index_score.pooled_fp4 import csa2_index_score_fp4_pooled

    n = 1000
    dtype = torch.float32 if interpreting() else torch.bfloat16
    codes, exps = _fp4_keys_of_every_exponent(gen, n)
    q = (2.0 ** torch.arange(4.0)).repeat_interleave(32).expand(1, 1, 32, 128).to(dtype)  # group g: 2^g
    w = torch.ones(1, 1, 32)
    if launch.startswith("listed"):
        entries = torch.randperm(n, generator=gen)[:700].to(torch.int32).view(1, 1, 700)
        over = {"BLOCK_N": 128, "BLOCKS": 4, "STAGES": 3} if launch == "listed_pipelined" else {}
        over["EXP_WORDS"] = True
        got = csa2_index_score_fp4_pooled(*on_device(q, w, codes, exps, entries), overrides=over)
        want = index_ref.csa2_index_score_fp4_pooled(q.float(), w, codes, exps, entries)
    else:
        visible = torch.ones(1, 1, n, dtype=torch.bool)
        got = index_kernel.csa2_index_score_fp4(*on_device(q, w, codes, exps, visible),
                                                overrides=FP4_WORD_LAUNCHES[launch])
        want = index_ref.csa2_index_score_fp4(q.float(), w, codes, exps, visible)
    assert torch.all(want > 0) and torch.equal(got.cpu(), want)


@triton.jit
def _fp4_keys_probe(codes_ptr, exps_ptr, out_ptr, N, J: tl.constexpr, BLOCK_N: tl.constexpr,
                    GP: tl.constexpr):
    """The FP4 kernel's key decode (bf16) written out, so it can be compared bit for bit."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    keys = index_kernel._fp4_keys(codes_ptr, exps_ptr, n, n < N, J, BLOCK_N, GP, tl.bfloat16)
    jj = tl.arange(0, GP * 32)
    tl.store(out_ptr + n[:, None] * J + jj[None, :], keys, mask=(n < N)[:, None] & (jj < J)[None, :])


@pytest.mark.parametrize("j", [128, 96])
def test_fp4_key_decode_bf16_is_exact(gen, j):
    """bf16 FP4 keys as the kernel decodes them equal the reference's unpacking exactly, normal
    and extreme exponents alike; this covers the decode where the interpreter cannot check the
    bf16 dot itself (its bf16 tl.dot is not emulated, so DTYPES is fp32 there)."""
    n, block = 150, 64
    k = torch.randn(1, n, j, generator=gen) * torch.logspace(-30, 30, n).view(1, n, 1)
    codes, exps = fp4_pow2_pack(k)
    # extreme exponents (127: keys overflow to inf as in the reference); on the GPU also those
    # that make bf16 subnormals (the interpreter's fp32 -> bf16 conversion does not round
    # subnormals as CUDA does)
    extremes = [127, -125, 126] + ([] if interpreting() else [-126, -128])
    for i, x in enumerate(extremes):
        exps[0, 140 + i, i % (j // 32)] = x
    out = torch.full((n, j), float("nan"), dtype=torch.bfloat16)
    c, e, o = on_device(codes[0], exps[0], out)
    _fp4_keys_probe[(triton.cdiv(n, block),)](c, e, o, n, J=j, BLOCK_N=block, GP=next_pow2(j // 32))
    want = index_ref.unpack_keys_fp4(codes, exps, torch.bfloat16)[0]
    # equal values (the sign of a zero key may differ: the interpreter's fp32 -> bf16 drops it)
    assert torch.equal(o.cpu().float(), want.float())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,h,d,n,k,t,n_split,cfg", [
    (2, 3, 5, 24, 40, 7, 11, 1, {}), (1, 1, 16, 64, 300, 70, 75, 1, {}), (1, 1, 16, 64, 300, 70, 75, 3, {}),
    (1, 4, 3, 130, 9, 3, 2, 2, {}),
    # 6 splits of one block, 2 head blocks (the last one partly masked)
    (1, 2, 20, 40, 90, 50, 30, 7, {"BLOCK_K": 16, "BLOCK_H": 16}),
    # 6 rows x 2 head blocks x 4 splits of 2 blocks each (the last split partly empty)
    (2, 3, 20, 40, 90, 50, 60, 4, {"BLOCK_K": 16, "BLOCK_H": 16}),
    (1, 64, 40, 256, 50, 8, 10, None, {}),  # 64 rows of a wide head, 3 head blocks
    # 40 rows of 64 wide heads in the batch form's blocks (one 64-head block, 8 warps, 2 stages),
    # 3 splits; on a GPU bf16 takes that form by itself (launch_config), fp32 never does
    (2, 20, 64, 256, 50, 40, 30, None, {}),
    (2, 20, 64, 256, 50, 40, 30, 3, {"BLOCK_H": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2}),
    # 64 heads of 384 dims in the batch form's blocks (BLOCK_D 512, masked): the form that takes
    # batch shapes the Gluon kernel cannot compile (kernel.gluon_shape_problem)
    (1, 3, 64, 384, 50, 40, 30, 2, {"BLOCK_H": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2}),
    # the ids of the selected entries loaded a step ahead: runs of several selected blocks per
    # split, a split holding the last selected block and the first window block, one split
    (2, 3, 20, 40, 90, 50, 60, 4, {"BLOCK_K": 16, "BLOCK_H": 16, "INDEX_AHEAD": True}),
    (1, 2, 20, 40, 90, 50, 30, 7, {"BLOCK_K": 16, "BLOCK_H": 16, "INDEX_AHEAD": True}),
    (1, 1, 16, 64, 300, 70, 75, 1, {"BLOCK_K": 16, "INDEX_AHEAD": True})])
def test_sparse_attention_kernel(gen, dtype, b, s, h, d, n, k, t, n_split, cfg):
    q = torch.randn(b, s, h, d, generator=gen).to(dtype)
    kv = torch.randn(b, n, d, generator=gen).to(dtype)
    idx = torch.randint(-1, n, (b, s, k), generator=gen)
    win = torch.randn(b, t, d, generator=gen).to(dtype)
    mask = torch.rand(b, s, t, generator=gen) > 0.4
    idx[-1, -1], mask[-1, -1] = -1, False  # a row with no key: all mass on the sink, output 0
    sink = torch.randn(h, generator=gen)
    args = (q, kv, idx, win, mask, sink, d ** -0.5)
    if DEVICE == "cuda" and dtype == torch.float32 and d > 256 and cfg.get("BLOCK_K") == 64:
        # fp32 tiles are twice bf16's: 64 heads x 512 and 64 keys x 512 need 279 KB of shared
        # memory in one stage or two, over the 227 KB an H100 / H200 program may hold (Triton
        # refuses it, naming both; H100, 2026-12-06); keys 32 at a time fit, with the 64-head block
        cfg = cfg | {"BLOCK_K": 32, "num_stages": 1}
    launcher = attn_kernel.SparseAttentionLauncher(overrides=cfg)
    for _ in range(2):  # the second call reuses the split path's workspace
        got = launcher(*on_device(*args), n_split=n_split)
        assert torch.count_nonzero(got[-1, -1]) == 0
        assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, dtype,
                              f"Csa2SparseAttention split={n_split}")


def test_sparse_attention_batch_form_rule():
    """64 wide heads from BATCH_ROWS rows: one head block of 8 warps, and splits that keep the
    grid to one program per SM; up to AHEAD_ROWS rows 32-key blocks in 3 stages with the ids
    loaded ahead, above 64-key blocks in 2 stages; fewer rows, other head counts, fp32 operands
    (their tiles would overflow shared memory) and the AOT build (rows unknown) keep the decode
    blocks."""
    rows = attn_splits.BATCH_ROWS
    for r in (rows, attn_splits.AHEAD_ROWS):
        batch = attn_splits.launch_config(64, 512, False, rows=r)
        assert (batch["BLOCK_H"], batch["BLOCK_K"], batch["num_warps"], batch["num_stages"],
                batch["INDEX_AHEAD"]) == (64, 32, 8, 3, True)
    many = attn_splits.launch_config(64, 512, False, rows=attn_splits.AHEAD_ROWS + 1)
    many_blocks = (many["BLOCK_H"], many["BLOCK_K"], many["num_stages"], many.get("INDEX_AHEAD", False))
    assert many_blocks == (64, 64, 2, False)
    # the TensorRT plugin's BATCH tactic runs unsplit (one program per row): the many-rows blocks
    from dsflash.plugins.csa2_sparse_attention import trt as attn_trt
    assert attn_trt.tactic_overrides(attn_trt.BATCH, torch.bfloat16, 64, 512) == {
        "BLOCK_H": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2}
    decode = attn_splits.launch_config(64, 512, False)
    assert decode == attn_splits.launch_config(64, 512, False, rows=rows - 1)
    assert (decode["BLOCK_H"], decode["num_warps"]) == (16, 4) and "num_stages" not in decode
    assert attn_splits.launch_config(40, 512, False, rows=64)["BLOCK_H"] == 16
    assert attn_splits.launch_config(64, 512, True, rows=64) == attn_splits.launch_config(64, 512, True)
    assert attn_splits.launch_config(64, 128, False, rows=64)["BLOCK_H"] == 64  # narrow heads: as before
    assert attn_splits.launch_config(64, 128, False, rows=64)["num_warps"] == 4
    assert [attn_splits.split_count(r, 1, 132) for r in (16, 32, 40, 64, 66, 67, 200)] == [8, 4, 3, 2, 2, 1, 1]
    # the Gluon form: about one program per two SMs (its measured best at 16-128 rows)
    assert [attn_splits.gluon_split_count(r, 132) for r in (16, 20, 32, 40, 64, 128)] == [4, 3, 2, 1, 1, 1]
    # ... which the JIT launch takes from GLUON_ROWS rows, below BATCH_ROWS too: 64 wide heads, 16-bit
    assert attn_splits.GLUON_ROWS == 4 < attn_splits.BATCH_ROWS
    assert [attn_splits.gluon_form(64, 512, r, False) for r in (None, 1, 3, 4, 8, 200)] == [
        False, False, False, True, True, True]
    assert attn_splits.gluon_form(64, 256, 4, False) and not attn_splits.gluon_form(64, 512, 8, True)
    assert not attn_splits.gluon_form(32, 512, 8, False) and not attn_splits.gluon_form(64, 128, 8, False)
    assert [attn_splits.gluon_split_count(r, 132) for r in (4, 8, 12)] == [16, 8, 5]


@pytest.mark.parametrize("heads,dim,dtype,message", [
    (64, 512, torch.bfloat16, None), (64, 256, torch.bfloat16, None), (64, 64, torch.float16, None),
    # batch-form shapes Gluon cannot compile (its tiles are powers of two): the Triton form takes them
    (64, 384, torch.bfloat16, r"GLUON takes head_dim 64, 128, 256 or 512 .*got 384"),
    (64, 192, torch.float16, r"got 192"),
    (32, 512, torch.bfloat16, r"GLUON takes 64 heads .*got 32"),
    (64, 512, torch.float32, r"GLUON takes bf16 or fp16, got torch.float32"),
])
def test_gluon_takes_the_shapes_it_compiles(heads, dim, dtype, message):
    problem = attn_kernel.gluon_shape_problem(heads, dim, dtype)
    assert problem is None if message is None else re.search(message, problem), problem


@pytest.mark.parametrize("dim,keys,stages,message", [
    (512, 64, 2, None), (512, 32, 4, None), (512, 32, 3, None), (256, 64, 3, None), (128, 64, 4, None),
    (512, 16, 4, "GLUON_KB must be 32 or 64, got 16"),
    (512, 32, 5, "GLUON_STAGES must be 2, 3 or 4, got 5"),
    (512, 64, 3, "GLUON_KB 64 in 3 stages needs 280640 bytes of shared memory at 64 heads x 512, over "
                 "the 232448"),
    (512, 64, 4, "needs 346184 bytes")])
def test_gluon_key_blocks_the_kernel_can_take(dim, keys, stages, message):
    """GLUON_KB / GLUON_STAGES: 32- or 64-key blocks in 2-4 stages, refused (naming the value and
    the limit) where the stages would not fit an sm_90 program's shared memory beside Q and p."""
    def check():
        attn_kernel.check_gluon_blocks(64, dim, torch.bfloat16, keys, stages)

    if message is None:
        check()
    else:
        with pytest.raises(ValueError, match=re.escape(message)):
            check()


def test_gluon_key_blocks_need_gluon(gen):
    """GLUON_KB or GLUON_STAGES without GLUON True would be ignored by the Triton form (and a sweep
    would claim a setting it did not run): refused."""
    args = attention_case(gen, torch.float32, 1, 2, 4, 32, 20, 5, 3)
    message = "['GLUON_STAGES'] set the Gluon form's blocks, but GLUON"
    with pytest.raises(ValueError, match=re.escape(message)):
        attn_kernel.SparseAttentionLauncher(overrides={"GLUON_STAGES": 4})(*on_device(*args))


@pytest.mark.parametrize("over,message", [
    ({"PREFETCH": -1}, "PREFETCH -1 must be 0 or a power of two"),
    ({"PREFETCH": 3}, "PREFETCH 3 must be 0 or a power of two"),
    ({"PREFETCH": 1.5}, "PREFETCH 1.5 must be 0 or a power of two"),
    ({"INDEX_AHEAD": 1}, "INDEX_AHEAD 1 must be True or False")]
    + ([({"PREFETCH": 2}, "PREFETCH 2 needs a GPU; the interpreter runs 0 only"),
        ({"GLUON": True}, "GLUON needs a GPU (Gluon kernels have no interpreter form)")] if interpreting()
       else [({"GLUON": True}, "GLUON takes 64 heads (one 64-row wgmma), got 4")]))
def test_sparse_attention_refuses_bad_gather_options(gen, over, message):
    """A prefetch distance that is not 0 or a power of two (one load of that many blocks' ids) is
    refused before any launch, naming it, as is any distance in the interpreter, which cannot run
    the inline PTX hint; INDEX_AHEAD takes booleans only. The warp-specialized form (GLUON) is
    refused in the interpreter and for shapes it does not take."""
    args = attention_case(gen, torch.float32, 1, 2, 4, 32, 20, 5, 3)
    with pytest.raises(ValueError, match=re.escape(message)):
        attn_kernel.SparseAttentionLauncher(overrides=over)(*on_device(*args))


@pytest.mark.parametrize("over", [None, {"GLUON": False}, {"INDEX_AHEAD": False}, {"NORMED_PARTS": True}])
def test_sparse_attention_launch_passes_only_kernel_parameters(gen, monkeypatch, over):
    """Every keyword the launcher hands csa2_sparse_attention_kernel is one of its parameters or a
    launch option: the interpreter ignores unknown keywords, a GPU launch raises on them (the
    launcher's GLUON choice once reached the Triton launch that way)."""
    kernel = attn_kernel.csa2_sparse_attention_kernel
    known = set(getattr(kernel, "arg_names", None) or kernel.fn.arg_names) | {"num_warps", "num_stages",
                                                                                "launch_pdl"}
    seen = []

    class Checked:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append(set(kwargs) - known)
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(attn_kernel, "csa2_sparse_attention_kernel", Checked())
    args = attention_case(gen, torch.float32, 1, 20, 64, 32, 50, 9, 7)  # 20 rows: the batch form's rows
    attn_kernel.SparseAttentionLauncher(overrides=over)(*on_device(*args))
    assert seen and not any(seen), f"unknown launch keywords {seen}"


@pytest.mark.parametrize("over,asked", [({}, False), ({"PDL": True}, True), ({"PDL": False}, False),
                                         ({"PDL": 1}, False), ({"GLUON": True, "NORMED_PARTS": True}, False)])
def test_gluon_form_launches_with_pdl_only_when_asked(monkeypatch, over, asked):
    """The Gluon attention asks pdl_launch_args for PDL only under an explicit {"PDL": True} (it
    measured slower with it, kernel.gluon_launch_pdl), where the Triton forms take it by default."""
    seen = []

    def spy(device, overrides=None):
        seen.append(dict(overrides))
        return {"PDL": False}

    monkeypatch.setattr(attn_kernel, "pdl_launch_args", spy)
    assert attn_kernel.gluon_launch_pdl(over, torch.device("cpu")) == {"PDL": False}
    assert seen == [{"PDL": asked}]


def test_sparse_attention_lists_every_override_it_reads():
    """SparseAttentionLauncher.OVERRIDES (what attention_ablation.py --attn-over accepts): every
    launch_config entry of either form and the kernel's tunable constants are in it, and every
    name in it is one of those, a launch option or a launcher choice (PDL, GLUON and the Gluon
    form's blocks, GLUON_KB / GLUON_STAGES)."""
    kernel = attn_kernel.csa2_sparse_attention_kernel
    params = set(getattr(kernel, "arg_names", None) or kernel.fn.arg_names)
    over = attn_kernel.SparseAttentionLauncher.OVERRIDES
    configs = [attn_splits.launch_config(h, d, ieee, rows) for h, d, ieee, rows in
               ((64, 512, False, 1), (64, 512, False, 20), (64, 512, False, 200), (16, 64, True, None))]
    assert set().union(*configs) <= over
    assert {"INDEX_AHEAD", "PREFETCH"} <= over & params
    # PDL is a kernel constant; NORMED_PARTS sets the split launches' NORMED
    assert over - params == {"num_warps", "num_stages", "GLUON", "GLUON_KB", "GLUON_STAGES", "NORMED_PARTS"}
    assert "NORMED" in params


def test_is_pow2_takes_int_powers_of_two_and_zero_only_where_asked():
    """The launchers' check of size overrides (tl.arange's sizes)."""
    from dsflash.plugins.launch import is_pow2

    assert [v for v in (1, 2, 3, 4, 6, 64, 96, 1024) if is_pow2(v)] == [1, 2, 4, 64, 1024]
    assert not any(is_pow2(v) for v in (0, -2, 2.0, "4", True, None))
    assert is_pow2(0, zero_ok=True) and not is_pow2(-4, zero_ok=True)


def attention_case(gen, dtype, b, s, h, d, n, k, t):
    q = torch.randn(b, s, h, d, generator=gen).to(dtype)
    kv = torch.randn(b, n, d, generator=gen).to(dtype)
    idx = torch.randint(-1, n, (b, s, k), generator=gen)
    win = torch.randn(b, t, d, generator=gen).to(dtype)
    mask = torch.rand(b, s, t, generator=gen) > 0.4
    idx[-1, -1], mask[-1, -1] = -1, False  # a row with no key: every split empty
    return q, kv, idx, win, mask, torch.randn(h, generator=gen), d ** -0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,h,d,n,k,t,block_keys,target", [
    (2, 3, 5, 24, 40, 7, 11, 16, 10),     # 2 splits; the first holds selected and window blocks
    (1, 1, 20, 40, 90, 50, 30, 16, 66),   # decode: 6 splits of one block, 2 head blocks
    (1, 2, 3, 8, 9, 0, 5, 16, 100),       # no selected entries at all
    (1, 37, 4, 16, 20, 3, 4, 16, 8)])     # many rows: one split each
def test_split_attention_kernels(gen, dtype, b, s, h, d, n, k, t, block_keys, target):
    """The split form's two kernels against their references, and together against the one-node
    reference (what a decoder_step graph computes)."""
    args = attention_case(gen, dtype, b, s, h, d, n, k, t)
    attrs = {"block_keys": block_keys, "split_target": target}
    acc, ml = attn_kernel.csa2_sparse_attention_split(*on_device(*args), **attrs)
    _, n_split = attn_splits.split_plan(b * s, k, t, d, block_keys, target)
    assert acc.shape == (b, s, n_split, h, d) and ml.shape == (b, s, n_split, 2, h)
    assert torch.equal(ml[-1, -1, :, 1].cpu(), torch.zeros(n_split, h))  # the empty row: l = 0
    assert_kernel_matches((acc, ml), attn_ref.csa2_sparse_attention_split, args, attrs, dtype,
                          f"Csa2SparseAttentionSplit {n_split} splits")
    q, sink = args[0], args[5]
    out = attn_kernel.csa2_attention_combine(*on_device(q, acc, ml, sink))
    assert torch.count_nonzero(out[-1, -1]) == 0
    assert_kernel_matches(out, attn_ref.csa2_sparse_attention, args, {}, dtype,
                          f"Csa2SparseAttentionSplit + Csa2AttentionCombine, {n_split} splits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,h,d,n,k,t,block_keys,target", [
    (2, 3, 5, 24, 40, 7, 11, 16, 10),     # 2 splits
    (1, 1, 20, 40, 90, 50, 30, 16, 66)])  # decode: 6 splits of one block
def test_combine_of_normed_partials(gen, dtype, b, s, h, d, n, k, t, block_keys, target):
    """csa2_attention_combine_normed (the combine kernel's NORMED form) against its reference, on
    the split kernel's partials each divided by its sum and rounded to the operands' dtype (a row
    with no key: l = 0, zeros), and against the one-node reference."""
    args = attention_case(gen, dtype, b, s, h, d, n, k, t)
    acc, ml = attn_kernel.csa2_sparse_attention_split(*on_device(*args), block_keys=block_keys,
                                                      split_target=target)
    l_p = ml[:, :, :, 1].unsqueeze(-1)
    parts = torch.where(l_p > 0, acc / l_p, 0.0).to(dtype).cpu()
    normed_args = (args[0], parts, ml.cpu(), args[5])
    out = attn_kernel.csa2_attention_combine_normed(*on_device(*normed_args))
    assert torch.count_nonzero(out[-1, -1]) == 0
    assert_kernel_matches(out, attn_ref.csa2_attention_combine_normed, normed_args, {}, dtype,
                          "Csa2AttentionCombine, normed partials")
    assert_kernel_matches(out, attn_ref.csa2_sparse_attention, args, {}, dtype,
                          "split + combine of normed partials")
    with pytest.raises(ValueError, match="acc has dtype torch.float16"):
        attn_kernel.csa2_attention_combine_normed(*on_device(args[0], parts.half(), ml, args[5]))


@pytest.mark.parametrize("rows,n_split", [(2, None), (3, 2), (5, 3)])
def test_sparse_attention_with_normed_partials(gen, monkeypatch, rows, n_split):
    """NORMED_PARTS: the split launch writes each partial divided by its sum in the operands'
    dtype and the combine weighs it back; the output matches the reference (a row with no key
    among them), and the combine did get partials of that dtype, NORMED."""
    args = attention_case(gen, torch.float32, 1, rows, 16, 64, 300, 40, 70)
    seen = []
    combine = attn_kernel._launch_combine

    def spy(q, acc, ml, sink, n, out, pdl, normed=False):
        seen.append((acc.dtype, normed, n))
        return combine(q, acc, ml, sink, n, out, pdl, normed)

    monkeypatch.setattr(attn_kernel, "_launch_combine", spy)
    launcher = attn_kernel.SparseAttentionLauncher(overrides={"NORMED_PARTS": True})
    got = launcher(*on_device(*args), n_split=n_split)
    assert seen and all(normed and dtype == args[0].dtype and n > 1 for dtype, normed, n in seen)
    assert torch.count_nonzero(got[-1, -1]) == 0
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, torch.float32,
                          f"normed partials, {rows} rows")
    with pytest.raises(ValueError, match="NORMED_PARTS 'yes' must be True or False"):
        attn_kernel.SparseAttentionLauncher(overrides={"NORMED_PARTS": "yes"})(*on_device(*args))


@pytest.mark.parametrize("nsp,chunk", [(8, 4), (8, 2), (16, 8)])
def test_combine_kernel_in_chunks(gen, nsp, chunk):
    """The combine kernel as the AOT plugin's CHUNKS tactic runs it: NSP above the splits present
    (the plugin compiles for the most a head_dim allows) and the outputs summed chunk by chunk,
    the last chunk part-filled (6 splits in chunks of 4, 2 or 8)."""
    b, s, h, d = 1, 3, 4, 40
    args = attention_case(gen, torch.float32, b, s, h, d, 90, 50, 30)
    attrs = {"block_keys": 16, "split_target": 18}
    acc, ml = attn_kernel.csa2_sparse_attention_split(*on_device(*args), **attrs)
    assert acc.shape[2] == 6
    q, sink = on_device(args[0], args[5])
    out = torch.full_like(q, float("nan"))
    attn_kernel.csa2_attention_combine_kernel[(b * s, h)](q, acc, ml, sink, 6, out, H=h, D=d,
                                                          BLOCK_D=next_pow2(d, 16), NSP=nsp, CHUNK=chunk)
    assert_kernel_matches(out, attn_ref.csa2_sparse_attention, args, {}, torch.float32,
                          f"Csa2AttentionCombine in chunks of {chunk}")


def test_split_attention_rejects_bad_input(gen):
    q, kv, idx, win, mask, sink, scale = on_device(*attention_case(gen, torch.float32, 1, 1, 4, 16, 20, 3, 4))
    with pytest.raises(ValueError, match="block_keys 24 is not one of the kernel's key blocks"):
        attn_kernel.csa2_sparse_attention_split(q, kv, idx, win, mask, sink, scale, 24, 8)
    with pytest.raises(ValueError, match="split_target 0 must be >= 1"):
        attn_kernel.csa2_sparse_attention_split(q, kv, idx, win, mask, sink, scale, 16, 0)
    acc, ml = attn_kernel.csa2_sparse_attention_split(q, kv, idx, win, mask, sink, scale, 16, 8)
    with pytest.raises(ValueError, match="ml has shape"):
        attn_kernel.csa2_attention_combine(q, acc, ml[:, :, :, :, :3], sink)
    with pytest.raises(ValueError, match="acc has dtype torch.float16"):
        attn_kernel.csa2_attention_combine(q, acc.half(), ml, sink)
    many = acc.new_zeros(1, 1, 1025, 4, 16), ml.new_zeros(1, 1, 1025, 2, 4)
    with pytest.raises(ValueError, match="1025 splits; the kernel combines 1 to 1024 at head_dim 16"):
        attn_kernel.csa2_attention_combine(q, *many, sink)


@pytest.mark.skipif(not interpreting(), reason="the interpreter's limit")
def test_dot_kernels_refuse_bf16_under_the_interpreter(gen):
    """The interpreter multiplies bf16 wrongly (values ~1e9 for outputs ~1): the launchers that
    use tl.dot refuse bf16 there with a clear error instead of returning that."""
    q, kv, idx, win, mask, sink, scale = attention_case(gen, torch.bfloat16, 1, 1, 4, 16, 20, 3, 4)
    with pytest.raises(ValueError, match="Csa2SparseAttention: q is bfloat16, which the Triton interpreter"):
        attn_kernel.csa2_sparse_attention(q, kv, idx, win, mask, sink, scale)
    qi = torch.randn(1, 1, 2, 16, generator=gen).bfloat16()
    w, k = torch.rand(1, 1, 2, generator=gen), torch.randn(1, 9, 16, generator=gen).bfloat16()
    with pytest.raises(ValueError, match="Csa2IndexScore: q is bfloat16"):
        index_kernel.csa2_index_score(qi, w, k, torch.ones(1, 1, 9, dtype=torch.bool))


def mhc_args(gen, b, s, c, e, dtype):
    n_mix = (2 + c) * c
    return (torch.randn(b, s, c, e, generator=gen).to(dtype), torch.randn(b, s, e, generator=gen).to(dtype),
            torch.rand(b, s, c, generator=gen) * 2, torch.rand(b, s, c, c, generator=gen),
            torch.rand(b, s, c, generator=gen) + 0.5, torch.randn(n_mix, c * e, generator=gen) * e ** -0.5,
            torch.randn(n_mix, generator=gen), torch.rand(3, generator=gen) + 0.5,
            torch.rand(e, generator=gen) + 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,c,e,n_split", [(2, 3, 4, 100, 1), (2, 3, 4, 100, 2), (1, 37, 2, 64, 1),
                                             (1, 1, 4, 200, 4), (1, 3, 4, 100, 3), (2, 20, 2, 96, 3),
                                             # prefill row blocks, whole rows or split channels,
                                             # channels a multiple of the chunk or not
                                             (1, 70, 4, 128, 2), (1, 70, 2, 72, 3), (1, 70, 2, 72, 1)])
def test_mhc_boundary_kernel(gen, dtype, b, s, c, e, n_split):
    args = mhc_args(gen, b, s, c, e, dtype)
    launcher = mhc_kernel.MhcBoundaryLauncher()
    attrs = dict(iters=20, hc_eps=1e-6, rms_eps=1e-6)
    for _ in range(2):  # the second call checks the split path cleared its counters
        got = launcher(*on_device(*args), **attrs, n_split=n_split)
        assert_kernel_matches(got, mhc_ref.mhc_boundary, args, attrs, dtype, f"MhcBoundary split={n_split}")
        # every token block's arrival count is back at zero for the next launch
        assert all(torch.count_nonzero(counter[:, 0]) == 0 for _, _, counter in launcher._ws.values())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,c,e,block_e,target,block_t", [
    (2, 3, 4, 100, 16, 2, None),    # 6 rows aim at 2 splits of 7 chunks (4 + 3); 16-row blocks
    (2, 3, 4, 100, 16, 2, 4),       # the same in blocks of 4 rows (a partial second block)
    (1, 1, 4, 200, 32, 264, None),  # decode: a split per chunk, the last one partial
    (1, 37, 2, 40, 16, 1, 1),       # one row per program, one split
    (1, 70, 2, 72, 16, 300, None)])  # prefill-sized row blocks, 5 splits of one chunk
def test_mhc_split_form_kernels(gen, dtype, b, s, c, e, block_e, target, block_t):
    """The split form's two kernels (split_form.py) against their references, and together
    against the one-node reference (what a decoder_step graph computes)."""
    from dsflash.plugins.mhc_boundary import split_form
    from dsflash.plugins.mhc_boundary import splits as mhc_splits

    args = mhc_args(gen, b, s, c, e, dtype)
    site = {"iters": 20, "hc_eps": 1e-6, "rms_eps": 1e-6}
    split = {"block_e": block_e, "split_target": target}
    parts = split_form.mhc_boundary_partials(*on_device(*args[:6]), **split, block_t=block_t)
    _, n_split = mhc_splits.split_plan(b * s, e, block_e, target)
    assert parts[2].shape == (n_split, b, s, (2 + c) * c) and parts[3].shape == (n_split, b, s, 2)
    assert_kernel_matches(parts, mhc_ref.mhc_boundary_partials, args[:6], split, dtype,
                          f"MhcBoundaryPartials {n_split} splits")
    cpu_parts = [t.cpu() for t in parts[1:]]
    done = split_form.mhc_boundary_finish(*parts[1:], *on_device(*args[6:]), **site, block_t=block_t)
    assert_kernel_matches(done, mhc_ref.mhc_boundary_finish, (*cpu_parts, *args[6:]), site, dtype,
                          f"MhcBoundaryFinish {n_split} splits")
    assert_kernel_matches((parts[0], *done), mhc_ref.mhc_boundary, args, site, dtype,
                          f"MhcBoundaryPartials + MhcBoundaryFinish, {n_split} splits")


def test_mhc_split_form_rejects_bad_input(gen):
    from dsflash.plugins.mhc_boundary import split_form

    args = on_device(*mhc_args(gen, 1, 2, 4, 64, torch.float32))
    site = {"iters": 3, "hc_eps": 1e-6, "rms_eps": 1e-6}
    with pytest.raises(ValueError, match="block_e 48 must be one of"):
        split_form.mhc_boundary_partials(*args[:6], 48, 8)
    with pytest.raises(ValueError, match="MhcBoundaryPartials: fn has shape"):
        split_form.mhc_boundary_partials(*args[:5], args[5][:, :-1], 16, 8)
    _, x_raw, mixes, sums = split_form.mhc_boundary_partials(*args[:6], 16, 8)
    with pytest.raises(ValueError, match="23 mixes is not"):
        split_form.mhc_boundary_finish(x_raw, mixes[..., :23], sums, *args[6:], **site)
    with pytest.raises(ValueError, match="sums has shape"):
        split_form.mhc_boundary_finish(x_raw, mixes, sums[:1], *args[6:], **site)
    many = mixes.new_zeros(257, 1, 2, 24), sums.new_zeros(257, 1, 2, 2)
    with pytest.raises(ValueError, match="257 splits; the kernel merges 1 to 256"):
        split_form.mhc_boundary_finish(x_raw, *many, *args[6:], **site)
    with pytest.raises(ValueError, match="sinkhorn iters 0 < 1"):
        split_form.mhc_boundary_finish(x_raw, mixes, sums, *args[6:], **(site | {"iters": 0}))


def test_launchers_keep_a_replaced_workspace(gen):
    """A larger call replaces a launcher's workspace and keeps the old one allocated (a captured
    CUDA graph may still use it); both calls are right, and the old counters are back at zero."""
    from dsflash.plugins.launch import LauncherBase

    base = LauncherBase()
    small = base._reuse_or_make("k", lambda ws: ws.numel() >= 10, lambda: torch.zeros(16))
    assert base._reuse_or_make("k", lambda ws: ws.numel() >= 12, lambda: torch.zeros(99)) is small
    assert base._reuse_or_make("k", lambda ws: ws.numel() >= 20, lambda: torch.zeros(32)) is not small
    assert base._retired == [small]
    launcher = mhc_kernel.MhcBoundaryLauncher()
    attrs = dict(iters=20, hc_eps=1e-6, rms_eps=1e-6)
    for s in (1, 37):  # 1 token: splits of one row; 37 tokens: more slots and token blocks
        args = mhc_args(gen, 1, s, 4, 200, torch.float32)
        got = launcher(*on_device(*args), **attrs, n_split=3)
        assert_kernel_matches(got, mhc_ref.mhc_boundary, args, attrs, torch.float32, f"mhc {s} tokens")
    (old,) = launcher._retired
    assert old[0].shape[0] < next(iter(launcher._ws.values()))[0].shape[0]
    assert torch.count_nonzero(old[2][:, 0]) == 0


@pytest.mark.parametrize("tokens, block_t, want", [
    (1, 1, (1, 160)),        # decode: 160 chunks of 32 channels, one per program (2 x 132 > 160)
    (64, 16, (3, 54)),       # 4 row blocks: 66 splits wanted, 54 splits of 3 chunks (no empty one)
    (8192, 64, (160, 1)),    # 128 row blocks: one program per SM already, whole rows
    (1024, 64, (20, 8)),     # 16 row blocks x 8 splits = 128 programs <= 132 SMs
    (65, 64, (3, 54)),       # 2 row blocks: 132 // 2 = 66 splits wanted, 54 of 3 chunks
])
def test_mhc_channel_splits_cover_the_gpu_once_for_prefill(tokens, block_t, want):
    per, n_split = mhc_kernel.channel_splits(tokens, -(-tokens // block_t), 160, 132)
    assert (per, n_split) == want
    assert (n_split - 1) * per < 160 <= n_split * per  # every split has chunks, all are covered
    assert mhc_kernel.channel_splits(tokens, 1, 160, 132, n_split=1000) == (1, 160)  # capped by chunks


def test_mhc_boundary_kernel_rejects_bad_input(gen):
    args = list(mhc_args(gen, 1, 2, 3, 16, torch.float32))
    with pytest.raises(ValueError, match="hc_mult 3"):
        mhc_kernel.mhc_boundary(*on_device(*args), 20, 1e-6, 1e-6)
    args = list(mhc_args(gen, 1, 2, 4, 16, torch.float32))
    args[5] = args[5][:, :-1]
    with pytest.raises(ValueError, match="fn has shape"):
        mhc_kernel.mhc_boundary(*on_device(*args), 20, 1e-6, 1e-6)


@pytest.mark.parametrize("topk_kernel,pool_form,kv_qat", [(False, "mask", False), (True, "mask", False),
                                                           (True, "list", False), (True, "list", True)])
def test_tiny_model_runs_on_the_kernels(tiny_cfg, gen, topk_kernel, pool_form, kv_qat):
    """The whole reference model with OpSet('triton') (and the top-k kernel; Reindex layers over
    the mask or the listed pool; kv_qat: FP4 index keys and entries as the cache holds them):
    same logits as the reference ops."""
    from dsflash.model.model import DSFlashModel

    from conftest import random_ids
    from tolerances import MODEL, assert_close

    cfg = tiny_cfg.replace(kv_qat=True, index_head_dim=32) if kv_qat else tiny_cfg
    model = DSFlashModel(cfg).init_weights(seed=1234).eval().to(DEVICE)
    ids = random_ids(gen, 1, 13, cfg.vocab_size).to(DEVICE)
    with torch.no_grad():
        expected = model(ids)
        model.ops.backend = "triton"
        model.ops.use_topk_kernel = topk_kernel
        model.ops.pool_form = pool_form
        got = model(ids)
    assert_close(got.cpu(), expected.cpu(), MODEL, "tiny logits, triton vs reference ops")


@pytest.mark.parametrize("kv_qat", [False, True])
def test_tiny_model_listed_pools_take_the_index_maxima(tiny_cfg, gen, kv_qat):
    """OpSet('triton').select_in_listed_pool with the index launch writing the block maxima
    (INDEX_MAXIMA on; the tiny pools take the block-max form over blocks of 2): every Reindex
    layer in the pool selects through listed_ids_with_maxima, and the logits are bit for bit those
    of the same ops without the maxima (the same selection). kv_qat: the FP4 keys' scores."""
    from dsflash.model.model import DSFlashModel

    from conftest import random_ids

    cfg = tiny_cfg.replace(kv_qat=True, index_head_dim=32) if kv_qat else tiny_cfg
    model = DSFlashModel(cfg).init_weights(seed=1234).eval().to(DEVICE)
    ids = random_ids(gen, 2, 13, cfg.vocab_size).to(DEVICE)
    model.ops.backend, model.ops.pool_form = "triton", "list"
    topk = model.ops._kernels["stable_topk"]  # the launcher whose overrides the two runs set
    calls = []
    with_maxima = model.ops._kernels["listed_topk_with_maxima"]
    model.ops._kernels["listed_topk_with_maxima"] = \
        lambda *args: calls.append(args[1].shape) or with_maxima(*args)
    with torch.no_grad():
        topk._overrides.update({"FORM": "prefilter", "BLOCK": 2})
        plain = model(ids)
        assert not calls
        topk._overrides["INDEX_MAXIMA"] = True
        got = model(ids)
    assert calls, "no layer took the index launch's maxima"
    assert torch.equal(got, plain)


def test_mhc_falls_back_when_the_cooperative_launch_is_refused(gen, monkeypatch):
    """Where the driver refuses the barrier's cooperative launch (fewer SMs than the device reports,
    e.g. an MPS client limited to a share of the GPU), the launcher runs the counter path instead
    and remembers that for the configuration; other launch errors still raise. The kernel is a
    stand-in that records its launches (the interpreter never takes the barrier path)."""
    launches = []

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                coop = kwargs.get("launch_cooperative_grid", False)
                launches.append(coop)
                if coop:
                    raise RuntimeError("Triton Error [CUDA]: too many blocks in cooperative launch")
            return launch

    monkeypatch.setattr(mhc_kernel, "mhc_boundary_kernel", Kernel())
    monkeypatch.setattr(mhc_kernel, "interpreting", lambda: False)  # the launcher's barrier decision
    launcher = mhc_kernel.MhcBoundaryLauncher()
    monkeypatch.setattr(launcher, "_barrier_fits", lambda key, *rest: launcher._fits.setdefault(key, True))
    args = on_device(*mhc_args(gen, 1, 20, 4, 200, torch.float32))  # 20 tokens: blocks of 16 rows
    for _ in range(2):
        launcher(*args, 20, 1e-6, 1e-6, n_split=3)
    assert launches == [True, False, False]  # refused once, then the counter path straight away
    assert list(launcher._fits.values()) == [False]

    class Broken(Kernel):
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
            return launch

    monkeypatch.setattr(mhc_kernel, "mhc_boundary_kernel", Broken())
    launcher._fits.clear()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        launcher(*args, 20, 1e-6, 1e-6, n_split=3)


@pytest.mark.parametrize("heads", [2, 16])
def test_opset_scores_kv_qat_fp4_keys_in_both_pool_forms(gen, heads):
    """What kv_qat models run on OpSet('triton'): the index keys as the cache holds them (FP4 codes
    and exponents), as a mask (Csa2IndexScoreFp4's launcher) and as a listed pool (the FP8 kernel
    at 16 heads; at 2 heads, too few for its products, the keys decoded for pooled.py's kernel)."""
    from dsflash.model import csa2_ops
    from dsflash.model.quant import fp4_pow2_pack, fp4_pow2_qat
    from dsflash.plugins.registry import OpSet

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q = fp4_pow2_qat(torch.randn(2, 3, heads, 64, generator=gen)).to(dtype)
    w = torch.randn(2, 3, heads, generator=gen)
    codes, exps = fp4_pow2_pack(torch.randn(2, 77, 64, generator=gen))
    visible = torch.rand(2, 3, 77, generator=gen) > 0.4
    entries = csa2_ops.pool_entry_list(visible, 60)
    ops = OpSet("triton")
    got = ops.csa2_index_score(*on_device(q, w, codes, visible, exps))
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4, (q, w, codes, exps, visible), {}, dtype,
                          "OpSet fp4 scores")
    listed = ops.csa2_index_score_pooled(*on_device(q, w, codes, entries, exps))
    assert_kernel_matches(listed, index_ref.csa2_index_score_fp4_pooled, (q, w, codes, exps, entries), {},
                          dtype, "OpSet fp4 listed scores")
    reference = OpSet("reference")
    assert torch.equal(reference.csa2_index_score(q, w, codes, visible, exps),
                       index_ref.csa2_index_score_fp4(q, w, codes, exps, visible))


@pytest.mark.parametrize("d,n,b,s,k,rows", [(32, 7, 2, 1, 3, 8), (96, 13, 3, 2, 5, 4), (512, 40, 1, 1, 19, 8),
                                            (64, 300, 2, 3, 70, 16)])
def test_entries_fp4_kernel_is_exact(gen, d, n, b, s, k, rows):
    """kv_qat's FP4 entries (Csa2EntriesFp4): the decode of the selected rows equals the reference
    bit for bit in every output dtype (a grid value times an e4m3 scale is exact), for packed
    QAT entries and for arbitrary code and scale bytes (every e4m3 scale, subnormals included);
    ids outside [0, N) give zero rows; rows across program blocks (ROWS)."""
    from dsflash.model.quant import fp4_e4m3scale_pack, fp4_e4m3scale_qat
    from dsflash.plugins.csa2_sparse_attention import entries_fp4

    x = torch.randn(b, n, d, generator=gen) * torch.logspace(-5, 4, n).view(1, n, 1)
    codes, scales = fp4_e4m3scale_pack(x)
    assert torch.equal(attn_ref.unpack_entries_fp4(codes, scales, torch.float32), fp4_e4m3scale_qat(x))
    any_codes = torch.randint(0, 256, codes.shape, generator=gen, dtype=torch.uint8)
    any_scales = torch.randint(0, 127, scales.shape, generator=gen, dtype=torch.uint8)
    idx = torch.randint(-2, n + 2, (b, s, k), generator=gen)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q = torch.zeros(b, s, 1, d, dtype=dtype)
        for c, sc in ((codes, scales), (any_codes, any_scales)):
            want = attn_ref.csa2_entries_fp4(q, c, sc, idx)
            for words in (True, False) if dtype.itemsize == 2 else (False,):  # 32-bit word stores or not
                over = {"ROWS": rows, "WORDS": words}
                got = entries_fp4.csa2_entries_fp4(*on_device(q, c, sc, idx), overrides=over)
                assert got.dtype == dtype and torch.equal(got.cpu(), want), (dtype, d, words)
    assert not want[idx.reshape(b, s * k) >= n].any() and not want[idx.reshape(b, s * k) < 0].any()


def test_entries_fp4_kernel_rejects_bad_input(gen):
    from dsflash.plugins.csa2_sparse_attention import entries_fp4

    q = torch.zeros(1, 1, 1, 32)
    codes = torch.zeros(1, 5, 16, dtype=torch.uint8)
    scales = torch.zeros(1, 5, 2, dtype=torch.uint8)
    idx = torch.zeros(1, 1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="scales has dtype torch.int8"):
        entries_fp4.csa2_entries_fp4(*on_device(q, codes, scales.to(torch.int8), idx))
    with pytest.raises(ValueError, match=r"scales has shape \(1, 5, 3\), expected \(1, 5, 2\)"):
        entries_fp4.csa2_entries_fp4(*on_device(q, codes, torch.zeros(1, 5, 3, dtype=torch.uint8), idx))
    with pytest.raises(ValueError, match="12 bytes per entry, not a multiple of 8"):
        entries_fp4.csa2_entries_fp4(*on_device(q, codes[..., :12], scales, idx))
    with pytest.raises(ValueError, match="idx has dtype torch.int32"):
        entries_fp4.csa2_entries_fp4(*on_device(q, codes, scales, idx.int()))


@pytest.mark.parametrize("form", ["selected", "all", "auto"])
def test_opset_attends_over_kv_qat_fp4_entries(gen, form):
    """What kv_qat models run: Csa2SparseAttention over the entries as the cache holds them (FP4
    codes + e4m3 scales) through OpSet.csa2_entries_fp4 (the selected rows decoded and the
    selection renumbered, or every entry decoded; the graphs' form), also as
    OpSet.csa2_sparse_attention_fp4 composes them, equals the attention over the QAT values, on the
    Triton and the reference backends."""
    from dsflash.model.quant import fp4_e4m3scale_pack, fp4_e4m3scale_qat
    from dsflash.plugins.registry import OpSet

    b, s, h, d, n, k, t = 2, 3, 4, 64, 50, 6, 9
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    x = torch.randn(b, n, d, generator=gen)
    codes, scales = fp4_e4m3scale_pack(x)
    q = torch.randn(b, s, h, d, generator=gen).to(dtype)
    idx = torch.randint(0, n, (b, s, k), generator=gen)
    idx[0, 1, 2:] = -1
    win = torch.randn(b, t, d, generator=gen).to(dtype)
    wmask = torch.rand(b, s, t, generator=gen) > 0.3
    sink = torch.randn(h, generator=gen)
    args = (q, fp4_e4m3scale_qat(x).to(dtype), idx, win, wmask, sink, d ** -0.5)
    for backend in ("reference", "triton"):
        ops = OpSet(backend, entry_form=form)
        kv, renumbered = ops.csa2_entries_fp4(*on_device(q, codes, scales, idx))
        rows = s * k if form == "selected" or (form == "auto" and s * k < n) else n
        assert kv.shape == (b, rows, d) and torch.equal(renumbered.cpu() < 0, idx < 0)
        got = ops.csa2_sparse_attention(*on_device(q, kv, renumbered, win, wmask, sink), d ** -0.5)
        assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, dtype,
                              f"attention over FP4 entries ({backend}, {form})")
        fused = ops.csa2_sparse_attention_fp4(*on_device(q, codes, scales, idx, win, wmask, sink), d ** -0.5)
        assert_kernel_matches(fused, attn_ref.csa2_sparse_attention, args, {}, dtype,
                              f"OpSet.csa2_sparse_attention_fp4 ({backend}, {form})")
    with pytest.raises(ValueError, match="unknown entry form 'some'"):
        OpSet("reference", entry_form="some")

