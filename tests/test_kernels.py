"""Every Triton kernel against its reference by the tolerance rule (tests/kernel_checks.py) on
small irregular shapes: lengths crossing the kernels' block sizes, odd head counts, rows with
nothing visible. On a machine without CUDA the kernels run in the Triton interpreter (conftest
sets TRITON_INTERPRET=1), which is how CI covers them; on the GPU the same tests run for real.
"""

from __future__ import annotations

import re

import pytest
import torch
from kernel_checks import assert_kernel_matches

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
from dsflash.plugins.stable_topk.keys import place_among  # noqa: E402
from dsflash.plugins.stable_topk.reference import block_maxima  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter computes in numpy (no bf16 arithmetic): check fp32 there, bf16 on the GPU too.
DTYPES = [torch.float32] if interpreting() else [torch.float32, torch.bfloat16]


def _dev(*ts):
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts]


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
    got = engram_kernel.engram_hash_gather(*_dev(*args))
    assert torch.equal(got.cpu(), engram_ref.engram_hash_gather(*args))  # a gather: bit-exact


def test_engram_gather_kernel_rejects_bad_input(gen):
    cids, rows, mult, primes, offsets = engram_case(gen, 1, 4, 2, 2, 8)
    small = torch.randn(rows - 1, 8, generator=gen)
    with pytest.raises(ValueError, match=f"table has {rows - 1} rows"):
        engram_kernel.engram_hash_gather(*_dev(cids, small), mult, primes, offsets, 7, 2)
    with pytest.raises(ValueError, match="cids has dtype torch.int32"):
        engram_kernel.engram_hash_gather(*_dev(cids.int(), small), mult, primes, offsets, 7, 2)
    with pytest.raises(ValueError, match="look \\* heads = 4"):
        engram_kernel.engram_hash_gather(*_dev(cids, small), mult, primes[:3], offsets[:3], 7, 2)


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
    got = index_kernel.csa2_index_score(*_dev(*args))
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
    got = pooled_kernel.csa2_index_score_pooled(*_dev(*args), overrides=over)
    assert_kernel_matches(got, index_ref.csa2_index_score_pooled, args, {}, dtype, "Csa2IndexScore(pooled)")
    got64 = pooled_kernel.csa2_index_score_pooled(*_dev(q, w, k, entries.long()), overrides=over)
    assert torch.equal(got64, got)
    with pytest.raises(ValueError, match="entries has dtype torch.int16"):
        pooled_kernel.csa2_index_score_pooled(*_dev(q, w, k, entries.short()))
    with pytest.raises(ValueError, match="entries has shape"):
        pooled_kernel.csa2_index_score_pooled(*_dev(q, w, k, entries[:, :, None]))


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
    scores, maxima = pooled_kernel.csa2_index_score_pooled_maxima(*_dev(*args), block, overrides=over)
    assert maxima.shape == (b, s, -(-p // block))
    assert torch.equal(scores, pooled_kernel.csa2_index_score_pooled(*_dev(*args), overrides=over))
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
        pooled_kernel.csa2_index_score_pooled_maxima(*_dev(*args), 32, overrides={"BLOCK_N": 16})
    with pytest.raises(ValueError, match="runs of 3 slots"):
        pooled_kernel.csa2_index_score_pooled_maxima(*_dev(*args), 3)


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
    got = pooled_fp4.csa2_index_score_fp4_pooled(*_dev(*args), overrides=over)
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4_pooled, args, {}, dtype,
                          f"Csa2IndexScore(fp4, pooled, {over})")
    assert torch.equal(pooled_fp4.csa2_index_score_fp4_pooled(*_dev(q, w, codes, exps, entries.long()),
                                                              overrides=over), got)
    # with the block maxima the top-k takes from it: the same scores, and their maxima bit for bit
    scores, maxima = pooled_fp4.csa2_index_score_fp4_pooled_maxima(*_dev(*args), 8, overrides=over)
    assert torch.equal(scores, got) and torch.equal(maxima, block_maxima(got, 8))
    with pytest.raises(ValueError, match="power-of-two head count >= 16, got 12"):
        pooled_fp4.csa2_index_score_fp4_pooled(*_dev(q[:, :, :12], w[:, :, :12], codes, exps, entries))
    other = torch.float64 if interpreting() else torch.float32
    with pytest.raises(ValueError, match=f"q has dtype {other}"):
        pooled_fp4.csa2_index_score_fp4_pooled(*_dev(q.to(other), w, codes, exps, entries))
    with pytest.raises(ValueError, match="entries has shape"):
        pooled_fp4.csa2_index_score_fp4_pooled(*_dev(q, w, codes, exps, entries[:, :1]))


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
    got = pool_list.pool_entry_list(*_dev(member), size, overrides={"SEG": chunk})
    assert torch.equal(got.cpu(), csa2_ops.pool_entry_list(member, size))


def _listed_case(gen, rows: int, p: int, pooled: int, n: int):
    """Scores of a listed pool [rows, 1, p] over n entries: `pooled` members a row (ids ascending,
    -1 padded; the last row's pool shorter), -inf at padding and at the last row's first 5 members
    (an entry picked at -inf maps to -1 as padding does), ReLU ties rounded."""
    from dsflash.model import csa2_ops

    member = torch.zeros(rows, 1, n, dtype=torch.bool)
    for r in range(rows):
        member[r, 0, torch.randperm(n, generator=gen)[:pooled if r < rows - 1 else pooled // 3]] = True
    entries = csa2_ops.pool_entry_list(member, p)
    scores = torch.relu(torch.randn(rows, 1, p, generator=gen)).round(decimals=1)
    scores[-1, 0, :5] = float("-inf")
    return scores.masked_fill(entries < 0, float("-inf")), entries


@pytest.mark.parametrize("form", ["radix", "prefilter", "prefilter-each", "prefilter-chunk-ties"])
@pytest.mark.parametrize("k,p", [(40, 300), (40, 30), (300, 300)])
def test_stable_topk_listed_ids_are_the_two_ops(gen, form, k, p):
    """StableTopkLauncher.listed_ids (the rank launch writes entry ids) against
    csa2_ops.select_listed_topk with the reference sort and picks, bit for bit, in both forms (the
    block-max form's passes fused and a launch each, its ties written by the rank programs and by
    programs of their own): padding picked where a row's pool is short of k (-1), a list of 300
    holding fewer than k = 300 members, a list of P = 30 < k (its 30 columns padded to min(k, N) =
    40), and the tied zeros at the k-th place; twice on one launcher."""
    from dsflash.model import csa2_ops
    from dsflash.plugins.stable_topk import kernel as topk_kernel

    n = 3000
    scores, entries = _listed_case(gen, 3, p, 250 if p > 250 else 20, n)
    over = {"radix": {"FORM": "radix"}, "prefilter": {"FORM": "prefilter", "BLOCK": 2},
            "prefilter-each": {"FORM": "prefilter", "BLOCK": 2, "PASS_LAUNCH": "each"},
            "prefilter-chunk-ties": {"FORM": "prefilter", "BLOCK": 2, "TIES": "chunk", "CHUNK": 64}}[form]
    launcher = topk_kernel.StableTopkLauncher(overrides=over)
    want = csa2_ops.select_listed_topk(scores, entries, k, n)
    for _ in range(2):
        got = launcher.listed_ids(*_dev(scores, entries), k, n)
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)
        _assert_topk_workspaces_cleared(launcher)


@pytest.mark.parametrize("over", [{}, {"EARLY_SLACK": "off"}, {"DIGITS": (11, 11, 10)}],
                         ids=["default", "every-pass", "11-bit-digits"])
@pytest.mark.parametrize("p", [300, 301])
def test_stable_topk_listed_ids_with_the_index_maxima_are_the_two_ops(gen, monkeypatch, over, p):
    """listed_ids_with_maxima: the block maxima given (as the listed index launch writes them), the
    fused passes do the first digit pass too and the first launch does not run; the ids equal
    csa2_ops.select_listed_topk's with the reference sort, bit for bit (tied zeros at the k-th
    place, padding picked on the short row, a last block past P), twice on one launcher (the
    fused program resets the slot counter the collect counts from), with every pass run (no
    early stop) and with 11-bit digits."""
    from dsflash.model import csa2_ops
    from dsflash.plugins.stable_topk import kernel as topk_kernel

    n, k = 3000, 40
    scores, entries = _listed_case(gen, 3, p, 250, n)
    launcher = topk_kernel.StableTopkLauncher(overrides={"FORM": "prefilter", "BLOCK": 2, "INDEX_MAXIMA": True}
                                              | over)
    assert launcher.maxima_block(3, p, k) == 2
    want = csa2_ops.select_listed_topk(scores, entries, k, n)

    class NotLaunched:
        def __getitem__(self, grid):
            raise AssertionError("the block-max form's first launch ran although the maxima were given")

    monkeypatch.setattr(topk_kernel, "block_max_pass_kernel", NotLaunched())
    for _ in range(2):
        got = launcher.listed_ids_with_maxima(*_dev(scores, block_maxima(scores, 2), entries), k, n)
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)
        _assert_topk_workspaces_cleared(launcher)


def test_stable_topk_takes_index_maxima_only_where_its_form_reads_them(gen):
    """maxima_block: 0 unless INDEX_MAXIMA is on (off by default: not faster), and 0 where the form
    is not the block-max form with fused passes (a listed pool of 16K at k = 512 below 16 rows:
    radix; passes a launch each); else the form's block (8 for that pool from 16 rows). Maxima of
    another shape, or for a form that takes none, are refused naming them."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel

    assert topk_kernel.INDEX_MAXIMA_DEFAULT is False
    assert topk_kernel.StableTopkLauncher().maxima_block(32, 16384, 512) == 0
    on = topk_kernel.StableTopkLauncher(overrides={"INDEX_MAXIMA": True})
    assert on.maxima_block(16, 16384, 512) == on.maxima_block(128, 16384, 512) == 8
    assert on.maxima_block(8, 16384, 512) == 0
    each = topk_kernel.StableTopkLauncher(overrides={"INDEX_MAXIMA": True, "PASS_LAUNCH": "each"})
    assert each.maxima_block(32, 16384, 512) == 0
    with pytest.raises(ValueError, match="INDEX_MAXIMA must be a boolean, got 1"):
        topk_kernel.StableTopkLauncher(overrides={"INDEX_MAXIMA": 1}).maxima_block(32, 16384, 512)
    scores, entries = _listed_case(gen, 2, 64, 40, 500)
    small = topk_kernel.StableTopkLauncher(overrides={"FORM": "prefilter", "BLOCK": 2, "INDEX_MAXIMA": True})
    with pytest.raises(ValueError, match=r"maxima \(2, 1, 31\) must be \(2, 1, 32\) \(runs of 2"):
        small.listed_ids_with_maxima(*_dev(scores, block_maxima(scores, 2)[..., :31], entries), 8, 500)
    with pytest.raises(ValueError, match="2 rows of 64 scores at k = 8 take no block maxima"):
        on.listed_ids_with_maxima(*_dev(scores, block_maxima(scores, 2), entries), 8, 500)


def test_stable_topk_listed_ids_refuse_bad_input(gen):
    """Entries of another shape or dtype, a list longer than the entries it lists from (its k
    picks past min(k, n) columns), scores not [B, S, P]: a ValueError naming them before any
    launch."""
    from dsflash.plugins.stable_topk.kernel import StableTopkLauncher

    scores, entries = _listed_case(gen, 2, 64, 40, 500)
    launcher = StableTopkLauncher()
    with pytest.raises(ValueError, match=r"entries \(2, 1, 63\) must match the scores \(2, 1, 64\)"):
        launcher.listed_ids(*_dev(scores, entries[..., :63]), 8, 500)
    with pytest.raises(ValueError, match="entries has dtype torch.float32"):
        launcher.listed_ids(*_dev(scores, entries.float()), 8, 500)
    with pytest.raises(ValueError, match="a list of 64 entries over n = 7: the top-k's 8 columns exceed"):
        launcher.listed_ids(*_dev(scores, entries), 8, 7)
    with pytest.raises(ValueError, match="scores"):
        launcher.listed_ids(*_dev(scores[:, 0], entries[:, 0]), 8, 500)


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
        got = pool_list.listed_picks(*_dev(vals, pos, entries), width)
        assert torch.equal(got.cpu(), csa2_ops.listed_picks(vals, pos, entries, width))
    with pytest.raises(ValueError, match="width 36 < the top-k's 37"):
        pool_list.listed_picks(*_dev(vals, pos, entries), 36)
    with pytest.raises(ValueError, match="member has dtype torch.uint8"):
        pool_list.pool_entry_list(*_dev((entries > 0).to(torch.uint8)), 8)


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
    got = index_kernel.csa2_index_score(*_dev(*args), overrides=over)
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
    got = index_kernel.csa2_index_score_fp4(*_dev(*args))
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4, args, {}, dtype, "Csa2IndexScore(fp4)")
    with pytest.raises(ValueError, match="exps has dtype"):
        index_kernel.csa2_index_score_fp4(*_dev(q, w, codes, exps.int(), visible))


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
    got = index_kernel.csa2_index_score_fp4(*_dev(*args), overrides={"PATH": "mma"} | over)
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4, args, {}, dtype,
                          f"Csa2IndexScore(fp4, FP8, {over})")
    if j % 128:
        with pytest.raises(ValueError, match=f"EXP_WORDS needs J / 32 = {j // 32} exponents"):
            index_kernel.csa2_index_score_fp4(*_dev(*args), overrides={"PATH": "mma", "EXP_WORDS": True})
    with pytest.raises(ValueError, match="power-of-two head count >= 16, got 12"):
        index_kernel.csa2_index_score_fp4(*_dev(q[:, :, :12], w[:, :, :12], codes, exps, visible),
                                          overrides={"PATH": "mma"})
    with pytest.raises(ValueError, match="PATH 'fp8' is not one of"):
        index_kernel.csa2_index_score_fp4(*_dev(*args), overrides={"PATH": "fp8"})


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
    got = index_kernel.csa2_index_score_fp4(*_dev(q, w, codes, exps, visible), overrides={"PATH": path})
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
        got = csa2_index_score_fp4_pooled(*_dev(q, w, codes, exps, entries), overrides=over)
        want = index_ref.csa2_index_score_fp4_pooled(q.float(), w, codes, exps, entries)
    else:
        visible = torch.ones(1, 1, n, dtype=torch.bool)
        got = index_kernel.csa2_index_score_fp4(*_dev(q, w, codes, exps, visible),
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
    c, e, o = _dev(codes[0], exps[0], out)
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
        got = launcher(*_dev(*args), n_split=n_split)
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
        attn_kernel.SparseAttentionLauncher(overrides={"GLUON_STAGES": 4})(*_dev(*args))


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
        attn_kernel.SparseAttentionLauncher(overrides=over)(*_dev(*args))


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
    attn_kernel.SparseAttentionLauncher(overrides=over)(*_dev(*args))
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
    acc, ml = attn_kernel.csa2_sparse_attention_split(*_dev(*args), **attrs)
    _, n_split = attn_splits.split_plan(b * s, k, t, d, block_keys, target)
    assert acc.shape == (b, s, n_split, h, d) and ml.shape == (b, s, n_split, 2, h)
    assert torch.equal(ml[-1, -1, :, 1].cpu(), torch.zeros(n_split, h))  # the empty row: l = 0
    assert_kernel_matches((acc, ml), attn_ref.csa2_sparse_attention_split, args, attrs, dtype,
                          f"Csa2SparseAttentionSplit {n_split} splits")
    q, sink = args[0], args[5]
    out = attn_kernel.csa2_attention_combine(*_dev(q, acc, ml, sink))
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
    acc, ml = attn_kernel.csa2_sparse_attention_split(*_dev(*args), block_keys=block_keys,
                                                      split_target=target)
    l_p = ml[:, :, :, 1].unsqueeze(-1)
    parts = torch.where(l_p > 0, acc / l_p, 0.0).to(dtype).cpu()
    normed_args = (args[0], parts, ml.cpu(), args[5])
    out = attn_kernel.csa2_attention_combine_normed(*_dev(*normed_args))
    assert torch.count_nonzero(out[-1, -1]) == 0
    assert_kernel_matches(out, attn_ref.csa2_attention_combine_normed, normed_args, {}, dtype,
                          "Csa2AttentionCombine, normed partials")
    assert_kernel_matches(out, attn_ref.csa2_sparse_attention, args, {}, dtype,
                          "split + combine of normed partials")
    with pytest.raises(ValueError, match="acc has dtype torch.float16"):
        attn_kernel.csa2_attention_combine_normed(*_dev(args[0], parts.half(), ml, args[5]))


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
    got = launcher(*_dev(*args), n_split=n_split)
    assert seen and all(normed and dtype == args[0].dtype and n > 1 for dtype, normed, n in seen)
    assert torch.count_nonzero(got[-1, -1]) == 0
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, torch.float32,
                          f"normed partials, {rows} rows")
    with pytest.raises(ValueError, match="NORMED_PARTS 'yes' must be True or False"):
        attn_kernel.SparseAttentionLauncher(overrides={"NORMED_PARTS": "yes"})(*_dev(*args))


@pytest.mark.parametrize("nsp,chunk", [(8, 4), (8, 2), (16, 8)])
def test_combine_kernel_in_chunks(gen, nsp, chunk):
    """The combine kernel as the AOT plugin's CHUNKS tactic runs it: NSP above the splits present
    (the plugin compiles for the most a head_dim allows) and the outputs summed chunk by chunk,
    the last chunk part-filled (6 splits in chunks of 4, 2 or 8)."""
    b, s, h, d = 1, 3, 4, 40
    args = attention_case(gen, torch.float32, b, s, h, d, 90, 50, 30)
    attrs = {"block_keys": 16, "split_target": 18}
    acc, ml = attn_kernel.csa2_sparse_attention_split(*_dev(*args), **attrs)
    assert acc.shape[2] == 6
    q, sink = _dev(args[0], args[5])
    out = torch.full_like(q, float("nan"))
    attn_kernel.csa2_attention_combine_kernel[(b * s, h)](q, acc, ml, sink, 6, out, H=h, D=d,
                                                          BLOCK_D=next_pow2(d, 16), NSP=nsp, CHUNK=chunk)
    assert_kernel_matches(out, attn_ref.csa2_sparse_attention, args, {}, torch.float32,
                          f"Csa2AttentionCombine in chunks of {chunk}")


def test_split_attention_rejects_bad_input(gen):
    q, kv, idx, win, mask, sink, scale = _dev(*attention_case(gen, torch.float32, 1, 1, 4, 16, 20, 3, 4))
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
        got = launcher(*_dev(*args), **attrs, n_split=n_split)
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
    parts = split_form.mhc_boundary_partials(*_dev(*args[:6]), **split, block_t=block_t)
    _, n_split = mhc_splits.split_plan(b * s, e, block_e, target)
    assert parts[2].shape == (n_split, b, s, (2 + c) * c) and parts[3].shape == (n_split, b, s, 2)
    assert_kernel_matches(parts, mhc_ref.mhc_boundary_partials, args[:6], split, dtype,
                          f"MhcBoundaryPartials {n_split} splits")
    cpu_parts = [t.cpu() for t in parts[1:]]
    done = split_form.mhc_boundary_finish(*parts[1:], *_dev(*args[6:]), **site, block_t=block_t)
    assert_kernel_matches(done, mhc_ref.mhc_boundary_finish, (*cpu_parts, *args[6:]), site, dtype,
                          f"MhcBoundaryFinish {n_split} splits")
    assert_kernel_matches((parts[0], *done), mhc_ref.mhc_boundary, args, site, dtype,
                          f"MhcBoundaryPartials + MhcBoundaryFinish, {n_split} splits")


def test_mhc_split_form_rejects_bad_input(gen):
    from dsflash.plugins.mhc_boundary import split_form

    args = _dev(*mhc_args(gen, 1, 2, 4, 64, torch.float32))
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
        got = launcher(*_dev(*args), **attrs, n_split=3)
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
        mhc_kernel.mhc_boundary(*_dev(*args), 20, 1e-6, 1e-6)
    args = list(mhc_args(gen, 1, 2, 4, 16, torch.float32))
    args[5] = args[5][:, :-1]
    with pytest.raises(ValueError, match="fn has shape"):
        mhc_kernel.mhc_boundary(*_dev(*args), 20, 1e-6, 1e-6)


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


@pytest.mark.parametrize("digits", [(8, 8, 8), (12, 10, 10), (0, 16, 16)])
def test_stable_topk_rejects_bad_digit_schedules(digits):
    """A digit schedule that does not cover the 32-bit key, or has a digit the kernel cannot hold,
    is refused before any launch, naming the widths."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel

    launcher = topk_kernel.StableTopkLauncher(overrides={"DIGITS": digits})
    with pytest.raises(ValueError, match=r"digit widths .* 1\.\.11 bits each and add up to 32"):
        launcher(*_dev(torch.rand(1, 100)), 4)


@pytest.mark.parametrize("over", [{}, {"RANK_BLOCK": 2, "CMP_BLOCK": 64},
                                  {"RANK_BLOCK": 64, "CMP_BLOCK": 16}])
def test_stable_topk_launch_settings_are_exact(gen, over):
    """The default and the sweep's rank settings give the same bits with k over the rank pass's
    compare step (256 keys by default): small and large rank blocks, several compare steps."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    scores = torch.relu(torch.randn(1, 1500, generator=gen)).round(decimals=1)
    scores[0, 10:20] = float("-inf")
    launcher = topk_kernel.StableTopkLauncher(overrides=over | {"CHUNK": 128})
    for k in (300, 7):
        want_v, want_i = topk_ref.stable_topk(scores, k)
        got_v, got_i = launcher(*_dev(scores), k)
        assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v)
        _assert_topk_workspaces_cleared(launcher)


def test_stable_topk_chunks_grow_with_the_rows_of_a_batch():
    """512 entries per program for one decode row, larger chunks once a pass would launch more
    than 1,024 programs (the H200 sweep behind batch_chunk), never over 2,048; an override wins."""
    from dsflash.plugins.stable_topk.kernel import batch_chunk

    n = 131072
    assert [batch_chunk(rows, n) for rows in (1, 4, 8, 16, 64, 512)] == [512, 512, 1024, 2048, 2048, 2048]
    assert batch_chunk(64, 4096) == 512 and batch_chunk(3, 50) == 512


@pytest.mark.parametrize("skip_idle", [True, False])
def test_stable_topk_programs_without_entries_in_play_leave_no_stale_counts(gen, skip_idle):
    """After the first digit pass a chunk with no entry sharing the k-th's prefix skips its
    histogram (SKIP_IDLE); in the last pass it must still zero its tie counts, which the select
    pass sums over the chunks before its own. The first call leaves every chunk's counts at 128
    for the value 100 in the reused workspace; the second puts the tied 100s in the last two
    chunks only, so stale counts would shift their places."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    over = {"CHUNK": 128, "SKIP_IDLE": skip_idle, "FORM": "radix"}
    launcher = topk_kernel.StableTopkLauncher(overrides=over)
    everywhere = torch.full((2, 1024), 100.0)
    small = torch.rand(2, 1024, generator=gen)
    small[:, 768:] = 100.0
    for scores, k in ((everywhere, 300), (small, 150), (small, 256 + 40)):
        want_v, want_i = topk_ref.stable_topk(scores, k)
        got_v, got_i = launcher(*_dev(scores), k)
        assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v)


def _assert_topk_workspaces_cleared(launcher):
    """Histograms back at zero after a call, and the radix form's slot counter (the block-max
    form clears its counter at the start of a call instead: its last launch reads it)."""
    for ws in launcher._ws.values():
        assert torch.count_nonzero(ws["hist"]) == 0
        assert "cand" in ws or torch.count_nonzero(ws["counter"]) == 0


@pytest.mark.parametrize("rows,n,k,chunk", [(3, 50, 4, None), (2, 300, 8, 64), (1, 1000, 16, 128),
                                            (2, 5, 8, None), (1, 3000, 100, 256), (2, 700, 1, 128),
                                            (1, 64, 64, 16)])
@pytest.mark.parametrize("digits", [None, (11, 11, 10), (5, 9, 7, 11)])
@pytest.mark.parametrize("form", ["radix", "prefilter", "prefilter-each"])
def test_stable_topk_kernel_is_exact(gen, rows, n, k, chunk, digits, form):
    """Same indices and values as the stable sort, bit for bit: ties (ReLU zeros, rounded
    values) to the lower index across chunks, -inf / +inf, k > N, k = 1, k = N, several chunks,
    twice on one launcher (its histograms and counters must clear), for the default digit
    schedule and two others (fewer, wider passes; uneven widths), in both forms (the block-max
    form falls back to the radix one where a row has fewer than k blocks), the block-max form's
    passes over the maxima in one launch (its default here) and in a launch each."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    scores = torch.relu(torch.randn(rows, n, generator=gen)).round(decimals=1)
    scores[0, ::7] = float("-inf")
    scores[-1, 3] = float("inf")
    over = ({"CHUNK": chunk} if chunk else {}) | ({"DIGITS": digits} if digits else {}) | {"FORM": form}
    if form == "prefilter-each":
        over |= {"FORM": "prefilter", "PASS_LAUNCH": "each"}
    launcher = topk_kernel.StableTopkLauncher(overrides=over)
    want_v, want_i = topk_ref.stable_topk(scores, k)
    for _ in range(2):
        got_v, got_i = launcher(*_dev(scores), k)
        assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v)
        _assert_topk_workspaces_cleared(launcher)  # for the next call (CUDA-graph replay)


def _block_max_cases(gen) -> dict:
    """Rows that stress the block-max form's bound (prefilter.py): name -> (scores, k)."""
    n = 2000
    ascending = torch.arange(n, dtype=torch.float32).expand(2, n).clone()  # the best all in the last blocks
    ascending[1] = ascending[1].flip(0)
    sparse_ties = torch.full((1, n), -1.0)
    sparse_ties[0, ::100] = 0.0  # 20 zeros, one per 100 entries: the k-th best is a tie spread over chunks
    sparse_ties[0, [5, 1234, 1999]] = 3.0
    runs = torch.relu(torch.randn(3, n, generator=gen)).round(decimals=1)
    runs[:, 640:700] = 9.0  # one run of equal best scores across blocks
    return {"ascending": (ascending, 20), "sparse ties": (sparse_ties, 15), "equal run": (runs, 40),
            "all equal": (torch.zeros(2, n), 33), "all -inf": (torch.full((2, n), float("-inf")), 10)}


@pytest.mark.parametrize("case", ["ascending", "sparse ties", "equal run", "all equal", "all -inf"])
@pytest.mark.parametrize("block", [2, 8, 32])
@pytest.mark.parametrize("pass_launch", ["fused", "each", "fused-4-warps"])
def test_stable_topk_block_max_form_is_exact_at_its_bounds(gen, case, block, pass_launch):
    """The block-max form against the stable sort, bit for bit, where it works hardest: the k best
    in the last blocks (the most entries above the k-th block maximum, (k - 1) x BLOCK, several
    strides of the rank programs), ties of the k-th best spread over chunks (written after the
    entries above it, in index order), a run of equal best scores, all equal, all -inf; one
    launcher for all of them, so a stale count or histogram would show; the digit passes over the
    maxima in one program per row (4 and 8 warps) and in a launch each."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    scores, k = _block_max_cases(gen)[case]
    launcher = topk_kernel.StableTopkLauncher(overrides={"FORM": "prefilter", "BLOCK": block, "CHUNK": 256,
                                                         "RANK_BLOCK": 2, "PASS_LAUNCH": pass_launch[:5],
                                                         "PASS_WARPS": 4 if "4" in pass_launch else 8})
    assert launcher._form(scores.shape[-1], k, block, scores.shape[0]) == ("prefilter", block)
    want_v, want_i = topk_ref.stable_topk(scores, k)
    for _ in range(2):
        got_v, got_i = launcher(*_dev(scores), k)
        assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v)
        _assert_topk_workspaces_cleared(launcher)


@pytest.mark.parametrize("case", ["ascending", "sparse ties", "equal run", "all equal", "all -inf"])
@pytest.mark.parametrize("over", [{"COLLECT": "chunk"}, {"LIVE_BLOCKS": 1}, {"LIVE_BLOCKS": 4, "CHUNK": 64},
                                  {"BM_CHUNK": 1}, {"BM_CHUNK": 512}, {"TIES": "chunk", "TIE_STEP": 64, "EARLY_SLACK": "off"},
                                  {"TIES": "rank", "RANK_BLOCK": 64, "CHUNK": 16},
                                  {"RANK_COVER": 1, "RANK_BLOCK": 2},
                                  {"RANK_COVER": 4, "RANK_BLOCK": 2, "TIE_STEP": 16, "EARLY_SLACK": "off"},
                                  {"CHUNK": 2048, "EARLY_SLACK": "off"},
                                  {"RANK_WARPS": 1, "RANK_BLOCK": 16}, {"RANK_WARPS": 2, "CMP_BLOCK": 64},
                                  {"BM_WARPS": 1, "COLLECT_WARPS": 1}, {"BM_WARPS": 2, "COLLECT": "chunk",
                                                                        "COLLECT_WARPS": 2},
                                  {"RANK_AHEAD": True, "CMP_BLOCK": 16}, {"RANK_TILE": True, "TIES": "chunk"},
                                  {"RANK_TILE": True, "RANK_AHEAD": True, "RANK_WARPS": 1, "CMP_BLOCK": 16}])
def test_stable_topk_block_max_collect_forms_are_exact(gen, case, over):
    """Both collect launches of the block-max form give the stable sort's bits on the bound cases:
    every chunk read whole ("chunk"), and only the live blocks (the default) listed and read one or
    a few at a time, so a program loops over its list (the k best in the last blocks: all of a
    program's blocks live; every block live when all scores are equal); and so does a first launch
    of one block per program or of more blocks than a row has (BM_CHUNK: 512 of its 250); and so
    do the ties at T written by programs of their own, one per chunk (TIES="chunk"; the default
    has the rank programs write them), and by a few rank programs that take every chunk of 16
    entries in turn; and so do rank launches with programs for k and for 4k candidates a round
    (RANK_COVER; the default 2k), and rank programs of one or two warps (RANK_WARPS), and first
    and collect launches of one or two (BM_WARPS, COLLECT_WARPS), and rank steps whose keys load
    into the compare's tile (RANK_TILE) or a step ahead (RANK_AHEAD), and tie paths that read a
    chunk of 256 in steps of 16 or 64 (TIE_STEP), or one of 2,048 in the default steps of 512,
    carrying the count of ties from step to step."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    scores, k = _block_max_cases(gen)[case]
    launcher = topk_kernel.StableTopkLauncher(overrides={"FORM": "prefilter", "BLOCK": 8, "CHUNK": 256} | over)
    want_v, want_i = topk_ref.stable_topk(scores, k)
    for _ in range(2):
        got_v, got_i = launcher(*_dev(scores), k)
        assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v)


@pytest.mark.parametrize("form", ["radix", "prefilter"])
def test_stable_topk_negative_zero_ties_with_zero(gen, form):
    """The reference's sort holds -0.0 equal to +0.0, so they keep index order; the keys once put
    -0.0 below +0.0 (both forms picked [4, 1, 3, 0] where the sort picks [4, 0, 1, 2] on the first
    row here; session 37). Both forms, the k-th best among zeros of either sign."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    first = torch.tensor([[-0.0, 0.0, -0.0, 0.0, 1.0, -1.0]]).expand(2, 6).clone()
    mixed = torch.relu(torch.randn(2, 1024, generator=gen)).round(decimals=0)
    mixed[:, ::3] = torch.where(mixed[:, ::3] == 0, -0.0, mixed[:, ::3])
    k = int((mixed[0] > 0).sum()) + 50  # 50 zeros of the first row taken, of either sign
    launcher = topk_kernel.StableTopkLauncher(overrides={"FORM": form, "BLOCK": 2})
    for scores, kk in ((first, 4), (mixed, k)):
        want_v, want_i = topk_ref.stable_topk(scores, kk)
        got_v, got_i = launcher(*_dev(scores), kk)
        assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v)


def test_stable_topk_default_takes_half_blocks_at_a_batch(gen):
    """At SMALL_BLOCK_ROWS rows a row of 256 entries with k = 8 (16 blocks of 16, under 4k; 32 of
    8) takes the block-max form over blocks of 8, as a listed pool of 16K does at k = 512, and
    gives the stable sort's bits (ties, -inf, +inf)."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    rows = topk_kernel.SMALL_BLOCK_ROWS
    scores = torch.relu(torch.randn(rows, 256, generator=gen)).round(decimals=1)
    scores[0, ::7] = float("-inf")
    scores[-1, 3] = float("inf")
    launcher = topk_kernel.StableTopkLauncher()
    assert launcher._form(256, 8, topk_kernel.PREFILTER_BLOCK, rows) == ("prefilter", 8)
    want_v, want_i = topk_ref.stable_topk(scores, 8)
    for _ in range(2):
        got_v, got_i = launcher(*_dev(scores), 8)
        assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v)


def test_stable_topk_block_max_launch_follows_the_rows():
    """One row collects from whole chunks and ranks 4 candidates per program; from 2 rows the
    collect reads the live blocks only, and the rank block grows once the launch would hold more
    than 2,048 rank programs (the H200 sweep behind rank_block_for)."""
    from dsflash.plugins.stable_topk.kernel import rank_block_for

    assert [rank_block_for(rows, 512) for rows in (1, 8, 16, 32, 64, 128, 4096)] == [4, 4, 4, 8, 16, 32, 64]
    assert rank_block_for(64, 64) == 4


def test_stable_topk_lists_every_override_it_reads():
    """StableTopkLauncher.OVERRIDES (what bench_layer_batch.py --topk-over accepts) names exactly
    the overrides the launcher reads, so a new one cannot be left out of it or an old one stay."""
    import inspect
    import re

    from dsflash.plugins.stable_topk import kernel as topk_kernel

    source = inspect.getsource(topk_kernel)
    read = set(re.findall(r'_overrides\.get\("(\w+)"', source)) | set(re.findall(r'_pow2\("(\w+)"', source))
    assert "pdl_launch_args(" in source  # PDL: read by plugins/pdl.py from the same overrides
    assert topk_kernel.StableTopkLauncher.OVERRIDES == read | {"PDL"}


def test_stable_topk_picks_its_form_by_blocks():
    """The block-max form serves rows of at least 4k blocks (a Full layer's 128K entries, one row
    or many); a listed pool of 16K (1,024 blocks of 16, 2,048 of 8) takes the radix form on fewer
    than SMALL_BLOCK_ROWS rows and the block-max form over blocks of 8 from there, unless BLOCK is
    set; a forced form it cannot serve (fewer than k blocks) falls back to the radix form; a bad
    FORM, BLOCK, CHUNK, COLLECT, LIVE_BLOCKS, RANK_BLOCK, CMP_BLOCK, BM_CHUNK, TIES, PASS_LAUNCH,
    PASS_WARPS, RANK_COVER, RANK_WARPS, RANK_TILE, RANK_AHEAD, TIE_STEP, BM_WARPS or COLLECT_WARPS is
    refused before any launch, naming it."""
    from dsflash.plugins.stable_topk.kernel import PREFILTER_BLOCK, SMALL_BLOCK_ROWS, StableTopkLauncher

    auto, forced = StableTopkLauncher(), StableTopkLauncher(overrides={"FORM": "prefilter"})
    for rows in (1, 64):
        assert auto._form(131072, 512, PREFILTER_BLOCK, rows) == ("prefilter", PREFILTER_BLOCK)
        assert auto._form(131072, 512, 8, rows) == ("prefilter", 8)
    assert auto._form(16384, 512, 16, SMALL_BLOCK_ROWS - 1) == ("radix", 16)
    assert auto._form(16384, 512, 16, SMALL_BLOCK_ROWS) == auto._form(16384, 512, 16, 64) == ("prefilter", 8)
    assert auto._form(16000, 512, 16, 64) == ("radix", 16)  # 2,000 blocks of 8 < 4 x 512
    sixteen = StableTopkLauncher(overrides={"BLOCK": 16})
    assert sixteen._form(16384, 512, 16, 64) == ("radix", 16)
    assert forced._form(4096, 512, 8, 1) == ("prefilter", 8) and forced._form(4000, 512, 8, 1) == ("radix", 8)
    with pytest.raises(ValueError, match="FORM must be 'radix' or 'prefilter', got 'row'"):
        StableTopkLauncher(overrides={"FORM": "row"})._form(4096, 8, 8, 1)
    with pytest.raises(ValueError, match="CHUNK must be a power of two of at least 16, got 100"):
        StableTopkLauncher(overrides={"CHUNK": 100})(*_dev(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="BLOCK must be a power of two in 2..512, got 12"):
        StableTopkLauncher(overrides={"BLOCK": 12})(*_dev(torch.rand(2, 4096)), 8)  # before any launch
    with pytest.raises(ValueError, match="COLLECT must be 'live' or 'chunk', got 'all'"):
        StableTopkLauncher(overrides={"COLLECT": "all"})(*_dev(torch.rand(1, 4096)), 8)
    with pytest.raises(ValueError, match="LIVE_BLOCKS must be a power of two or 'rounds', got 3"):
        StableTopkLauncher(overrides={"LIVE_BLOCKS": 3})(*_dev(torch.rand(1, 4096)), 8)
    for name, bad in (("RANK_BLOCK", 6), ("CMP_BLOCK", 0)):
        for scores in (torch.rand(2, 4096), torch.rand(2, 300)):  # the block-max and the radix form
            with pytest.raises(ValueError, match=f"{name} must be a power of two, got {bad}"):
                StableTopkLauncher(overrides={name: bad})(*_dev(scores), 8)
    with pytest.raises(ValueError, match="BM_CHUNK must be a power of two, got 24"):
        StableTopkLauncher(overrides={"BM_CHUNK": 24, "FORM": "prefilter"})(*_dev(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="TIES must be 'chunk' or 'rank', got 'all'"):
        StableTopkLauncher(overrides={"TIES": "all", "FORM": "prefilter"})(*_dev(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="PASS_WARPS must be a power of two, got 6"):
        StableTopkLauncher(overrides={"PASS_WARPS": 6, "FORM": "prefilter"})(*_dev(torch.rand(2, 4096)), 8)
    for name in ("BM_WARPS", "COLLECT_WARPS"):
        with pytest.raises(ValueError, match=f"{name} must be a power of two, got 5"):
            StableTopkLauncher(overrides={name: 5, "FORM": "prefilter"})(*_dev(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="RANK_WARPS must be a power of two, got 3"):
        StableTopkLauncher(overrides={"RANK_WARPS": 3, "FORM": "prefilter"})(*_dev(torch.rand(2, 4096)), 8)
    for name in ("RANK_TILE", "RANK_AHEAD"):
        with pytest.raises(ValueError, match=f"{name} must be True or False, got 1"):
            StableTopkLauncher(overrides={name: 1, "FORM": "prefilter"})(*_dev(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="TIE_STEP must be a power of two, got 48"):
        StableTopkLauncher(overrides={"TIE_STEP": 48, "FORM": "prefilter"})(*_dev(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="RANK_COVER must be 1, 2 or 4, got 3"):
        StableTopkLauncher(overrides={"RANK_COVER": 3, "FORM": "prefilter"})(*_dev(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="PASS_LAUNCH must be 'fused' or 'each', got 'one'"):
        StableTopkLauncher(overrides={"PASS_LAUNCH": "one", "FORM": "prefilter"})(*_dev(torch.rand(2, 4096)),
                                                                                  8)


def test_stable_topk_fuses_the_passes_over_a_listed_pools_maxima():
    """The digit passes after the first run in one program per row up to FUSED_PASS_BLOCKS maxima
    (a listed pool's 2,048 blocks of 8), a launch each above (a Full layer's 8,192 blocks of 16 at
    128K) and for schedules past 8 digits, whose widths do not pack; an override wins."""
    from dsflash.plugins.stable_topk.kernel import FUSED_PASS_BLOCKS, StableTopkLauncher, digit_passes

    auto = StableTopkLauncher()
    default = digit_passes((8, 8, 8, 8))
    assert FUSED_PASS_BLOCKS == 2048 == 16384 // 8
    assert auto._pass_launch(2048, default) == "fused" and auto._pass_launch(8192, default) == "each"
    assert auto._pass_launch(2048, digit_passes((4,) * 8)) == "fused"
    assert auto._pass_launch(2048, digit_passes((2,) * 16)) == "each"
    assert StableTopkLauncher(overrides={"PASS_LAUNCH": "each"})._pass_launch(2048, default) == "each"
    assert StableTopkLauncher(overrides={"PASS_LAUNCH": "fused"})._pass_launch(8192, default) == "fused"


def test_stable_topk_rank_programs_are_one_warp_from_16_rows(gen):
    """The block-max form's rank programs: one warp from RANK_ONE_WARP_ROWS rows (a decode batch),
    comparing 64 keys at a time loaded into the compare's tile a step ahead up to
    RANK_TILE_MAX_ROWS rows and 128 loaded as a vector above, the launch's warps comparing 256 in
    turn below 16 rows, the overrides winning; and 16 rows of a small listed-like case (the tile
    loads) give the stable sort's bits."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    auto = topk_kernel.StableTopkLauncher()
    assert topk_kernel.RANK_ONE_WARP_ROWS == 16 and topk_kernel.RANK_TILE_MAX_ROWS == 64
    assert auto._rank_shape(16, 4, 256) == auto._rank_shape(64, 4, 256) == (1, 64)
    assert auto._rank_shape(65, 4, 256) == auto._rank_shape(128, 4, 256) == (1, 128)
    assert auto._rank_shape(15, 4, 256) == (4, 256) and auto._rank_shape(1, 8, 64) == (8, 64)
    both, neither = {"RANK_TILE": True, "RANK_AHEAD": True}, {"RANK_TILE": False, "RANK_AHEAD": False}
    assert auto._rank_load(16) == auto._rank_load(64) == both
    assert auto._rank_load(15) == auto._rank_load(1) == auto._rank_load(65) == auto._rank_load(128) == neither
    over = topk_kernel.StableTopkLauncher(overrides={"RANK_WARPS": 2, "CMP_BLOCK": 32, "RANK_AHEAD": False})
    assert over._rank_shape(64, 4, 32) == (2, 32) and over._rank_shape(2, 4, 32) == (2, 32)
    assert over._rank_load(32) == {"RANK_TILE": True, "RANK_AHEAD": False}
    assert topk_kernel.StableTopkLauncher(overrides={"RANK_TILE": True})._rank_load(128)["RANK_TILE"]
    scores = torch.relu(torch.randn(16, 1024, generator=gen)).round(decimals=1)
    launcher = topk_kernel.StableTopkLauncher(overrides={"FORM": "prefilter", "BLOCK": 8})
    want_v, want_i = topk_ref.stable_topk(scores, 24)
    got_v, got_i = launcher(*_dev(scores), 24)
    assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v)


@triton.jit
def _place_among_probe(mine_ptr, keys_ptr, count, out_ptr, MINE: tl.constexpr, CMP_BLOCK: tl.constexpr,
                       TILE: tl.constexpr, AHEAD: tl.constexpr):
    """keys.place_among of MINE keys among `count` keys, written out."""
    i = tl.arange(0, MINE)
    mine = tl.load(mine_ptr + i)
    tl.store(out_ptr + i, place_among(mine, keys_ptr, count, CMP_BLOCK, TILE, AHEAD))


@pytest.mark.parametrize("tile", [False, True])
@pytest.mark.parametrize("ahead", [False, True])
def test_place_among_counts_the_keys_above_at_every_step_edge(gen, tile, ahead):
    """The rank's count of keys above each of its own, its steps' keys loaded as a vector or
    straight into the compare's tile (RANK_TILE), with and without the next step's loaded ahead
    (RANK_AHEAD), at counts of none, one, a step short of, at, and past a multiple of CMP_BLOCK:
    a step too many or too few, or a stale key carried into the last step, would show. The keys
    are unique 64-bit values with high words of both signs, as the full keys are."""
    cmp_block, n_mine = 16, 8
    keys = torch.randperm(1 << 12, generator=gen)[:80].long() * 0x9E3779B97F4A7C15 + 0x5BD1E995
    for count in (0, 1, 15, 16, 17, 48, 80):
        mine = keys[torch.randint(0, max(count, 1), (n_mine,), generator=gen)]
        out = torch.full((n_mine,), -1, dtype=torch.int32)
        m, k_, o = _dev(mine.view(torch.uint64), keys.view(torch.uint64), out)  # as the candidates are
        _place_among_probe[(1,)](m, k_, count, o, MINE=n_mine, CMP_BLOCK=cmp_block, TILE=tile, AHEAD=ahead)
        flip = -(1 << 63)  # the sign bit: signed order of key ^ flip = unsigned order of key
        unsigned = keys[:count].view(-1, 1).bitwise_xor(flip) > mine.view(1, -1).bitwise_xor(flip)
        assert torch.equal(o.cpu(), unsigned.sum(0).int()), count


def test_stable_topk_fused_passes_are_four_warps_from_8_rows():
    """The fused passes' program (one a row): 4 warps from PASS_FOUR_WARP_ROWS rows, 8 below, the
    override winning."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel

    auto = topk_kernel.StableTopkLauncher()
    assert topk_kernel.PASS_FOUR_WARP_ROWS == 8
    assert auto._pass_warps(8) == auto._pass_warps(128) == 4
    assert auto._pass_warps(7) == auto._pass_warps(1) == 8
    over = topk_kernel.StableTopkLauncher(overrides={"PASS_WARPS": 16})
    assert over._pass_warps(1) == over._pass_warps(64) == 16


def test_stable_topk_live_collect_is_one_warp(gen):
    """The block-max form's collect: one warp for the live collect (2 rows and more), the launch's
    warps for one row's whole chunks, the override winning; and rows of a listed-like case, through
    the live collect, give the stable sort's bits."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    auto = topk_kernel.StableTopkLauncher()
    assert auto._collect_warps("live", 4) == auto._collect_warps("live", 8) == 1
    assert auto._collect_warps("chunk", 4) == 4 and auto._collect_warps("chunk", 2) == 2
    over = topk_kernel.StableTopkLauncher(overrides={"COLLECT_WARPS": 2})
    assert over._collect_warps("live", 4) == over._collect_warps("chunk", 8) == 2
    scores = torch.relu(torch.randn(5, 2048, generator=gen)).round(decimals=1)
    launcher = topk_kernel.StableTopkLauncher(overrides={"FORM": "prefilter", "BLOCK": 8})
    want_v, want_i = topk_ref.stable_topk(scores, 40)
    got_v, got_i = launcher(*_dev(scores), 40)
    assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v)


# programs an H100 / H200 holds at once of the sm_90 collect builds at 32 / 16 / 8 live blocks a
# step (plugins/stable_topk/live_steps.py: 142 / 96 / 64 and 72 / 64 / 42 registers, one warp)
FULL_RESIDENT = {32: 14 * 132, 16: 21 * 132, 8: 32 * 132}
LISTED_RESIDENT = {32: 28 * 132, 16: 32 * 132, 8: 32 * 132}


@pytest.mark.parametrize("resident, programs, want, asked", [
    (FULL_RESIDENT, 1024, 32, [32]),          # 16 rows of 128K: 0.55 rounds
    (FULL_RESIDENT, 2048, 32, [32]),          # 32 rows: 1.11 rounds count as one
    (FULL_RESIDENT, 3072, 16, [32, 16]),      # 48 rows: 1.66 / 1.11
    (FULL_RESIDENT, 4096, 8, [32, 16, 8]),    # 64 rows: 2.22 / 1.48 / 0.97
    (FULL_RESIDENT, 8192, 8, [32, 16, 8]),    # 128 rows: none fits, 8 takes the fewest (1.94)
    (LISTED_RESIDENT, 1024, 32, [32]),        # a listed pool at 32-128 rows (its chunks grow): 0.28
    (LISTED_RESIDENT, 8192, 16, [32, 16, 8]),  # no step fits: 16 and 8 tie at 1.94, more blocks win
])
def test_live_blocks_take_the_most_that_fit_one_round(resident, programs, want, asked):
    """The live collect's blocks a step against the session-49 H100 sweeps (live_steps.py's
    table): the most whose grid fits ROUND_SLACK rounds of the SM slots, else the fewest rounds;
    builds compiled only as far as the choice needs."""
    from dsflash.plugins.stable_topk.live_steps import live_blocks_for

    seen = []

    def resident_of(blocks):
        seen.append(blocks)
        return resident[blocks]

    assert live_blocks_for(programs, resident_of) == want
    assert seen == asked


def test_live_blocks_refuse_an_empty_grid_or_a_build_that_fits_nothing():
    from dsflash.plugins.stable_topk.live_steps import live_blocks_for

    with pytest.raises(ValueError, match="at least one program, got 0"):
        live_blocks_for(0, lambda blocks: 100)
    with pytest.raises(ValueError, match="a build of 32 blocks a step fits 0 programs"):
        live_blocks_for(64, lambda blocks: 0)


def test_stable_topk_live_blocks_count_each_build_once(monkeypatch):
    """The launcher's side of the rule off the interpreter (on a GPU the builds come from
    prefilter_collect_live_kernel.warmup and coresident.resident_programs, stood in for here): each
    build compiled once per configuration and remembered across grids, a new configuration
    compiled afresh."""
    from types import SimpleNamespace

    from dsflash.plugins.stable_topk import kernel as topk_kernel

    builds = []

    def warmup(*args, grid, LIVE_BLOCKS, **consts):
        builds.append((LIVE_BLOCKS, consts["CHUNK"]))
        return SimpleNamespace(blocks=LIVE_BLOCKS)

    monkeypatch.setattr(topk_kernel, "interpreting", lambda: False)
    monkeypatch.setattr(topk_kernel, "prefilter_collect_live_kernel", SimpleNamespace(warmup=warmup))
    monkeypatch.setattr(topk_kernel, "resident_programs",
                        lambda compiled, device: FULL_RESIDENT[compiled.blocks])
    args = (torch.empty(4), 131072, 8192, torch.empty(4), 4608)
    consts = {"CHUNK": 2048, "BLOCK": 16, "num_warps": 1}
    launcher = topk_kernel.StableTopkLauncher()
    assert launcher._live_blocks(3072, args, consts) == 16 and builds == [(32, 2048), (16, 2048)]
    assert launcher._live_blocks(2048, args, consts) == 32 and len(builds) == 2
    assert launcher._live_blocks(8192, args, consts) == 8 and builds[2:] == [(8, 2048)]
    assert launcher._live_blocks(3072, args, consts | {"CHUNK": 1024}) == 16
    assert builds[3:] == [(32, 1024), (16, 1024)]


def _order_key(values: torch.Tensor) -> torch.Tensor:
    """keys.order_key32 of finite fp32 values other than -0.0 (it clamps and maps -0.0 to +0.0
    first), as int64: an oracle in plain torch for the threshold the kernels leave."""
    bits = values.float().contiguous().view(torch.int32).long() & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@pytest.mark.parametrize("slack", [None, 0, "off"])
def test_stable_topk_fused_passes_stop_early_and_stay_exact(gen, slack):
    """The fused passes stop once a digit holds at most EARLY_SLACK blocks more than the k-th best
    maximum needs (prefilter.maxima_passes_kernel): on random scores the collect's threshold then
    lies below T, the k-th best block maximum, at a digit's edge; on a row of equal scores every
    digit holds all the blocks, so every pass runs and the threshold is T itself; "off" runs every
    pass. The picks are the stable sort's bits in every case, twice (a stale threshold would show)."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    k, block = 64, 8
    scores = torch.randn(3, 4096, generator=gen)
    scores[2] = 0.5  # every block's maximum equal
    over = {"FORM": "prefilter", "BLOCK": block} | ({} if slack is None else {"EARLY_SLACK": slack})
    launcher = topk_kernel.StableTopkLauncher(overrides=over)
    assert launcher._pass_launch(4096 // block, topk_kernel.digit_passes(topk_kernel.DIGITS)) == "fused"
    want_v, want_i = topk_ref.stable_topk(scores, k)
    for _ in range(2):
        got_v, got_i = launcher(*_dev(scores), k)
        assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v)
    (ws,) = [ws for key, ws in launcher._ws.items() if "prefilter" in key]
    t = ws["tval"][:3].cpu()
    exact = _order_key(scores.view(3, -1, block).amax(-1).sort(-1, descending=True).values[:, k - 1])
    assert t[2] == exact[2]  # equal maxima: no digit ever narrows the blocks in play
    if slack == "off":
        assert torch.equal(t, exact)
    else:  # stopped at a digit's edge below T (16 or 24 bits of the key known)
        assert (t[:2] < exact[:2]).all() and ((t[:2] + 1) % 256 == 0).all()


def test_stable_topk_refuses_a_bad_early_slack():
    from dsflash.plugins.stable_topk.kernel import StableTopkLauncher

    for bad in (-1, "never", True, 2.5):
        with pytest.raises(ValueError, match="EARLY_SLACK must be an int >= 0 or 'off'"):
            StableTopkLauncher(overrides={"EARLY_SLACK": bad, "FORM": "prefilter"})(*_dev(torch.rand(2, 4096)), 8)


@pytest.mark.parametrize("regs, warps, shared, want", [
    (128, 4, 50_000, 4 * 132),   # registers and shared memory both allow 4 per SM
    (24, 4, 0, 16 * 132),        # threads: 2048 / 128 (registers would allow 21)
    (255, 8, 0, 1 * 132),        # 255 -> 256 per thread: 64K / (8 warps x 8K)
    (32, 1, 0, 32 * 132),        # block slots
    (64, 4, 120_000, 1 * 132),   # shared memory: one block of 120 KB (+1 KB reserved) per SM
])
def test_resident_programs_follow_the_occupancy_rules(regs, warps, shared, want):
    """The count that decides whether a launch whose programs wait for each other fits one
    cooperative launch (MhcBoundary's barrier), against H200 figures worked by hand."""
    from types import SimpleNamespace

    from dsflash.plugins.coresident import programs_per_gpu

    h200 = SimpleNamespace(multi_processor_count=132, regs_per_multiprocessor=65536,
                           max_threads_per_multi_processor=2048, shared_memory_per_multiprocessor=233472,
                           max_blocks_per_multi_processor=32)
    compiled = SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(num_warps=warps, shared=shared))
    assert programs_per_gpu(compiled, h200) == want


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
    args = _dev(*mhc_args(gen, 1, 20, 4, 200, torch.float32))  # 20 tokens: blocks of 16 rows
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
    got = ops.csa2_index_score(*_dev(q, w, codes, visible, exps))
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4, (q, w, codes, exps, visible), {}, dtype,
                          "OpSet fp4 scores")
    listed = ops.csa2_index_score_pooled(*_dev(q, w, codes, entries, exps))
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
                got = entries_fp4.csa2_entries_fp4(*_dev(q, c, sc, idx), overrides=over)
                assert got.dtype == dtype and torch.equal(got.cpu(), want), (dtype, d, words)
    assert not want[idx.reshape(b, s * k) >= n].any() and not want[idx.reshape(b, s * k) < 0].any()


def test_entries_fp4_kernel_rejects_bad_input(gen):
    from dsflash.plugins.csa2_sparse_attention import entries_fp4

    q = torch.zeros(1, 1, 1, 32)
    codes = torch.zeros(1, 5, 16, dtype=torch.uint8)
    scales = torch.zeros(1, 5, 2, dtype=torch.uint8)
    idx = torch.zeros(1, 1, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="scales has dtype torch.int8"):
        entries_fp4.csa2_entries_fp4(*_dev(q, codes, scales.to(torch.int8), idx))
    with pytest.raises(ValueError, match=r"scales has shape \(1, 5, 3\), expected \(1, 5, 2\)"):
        entries_fp4.csa2_entries_fp4(*_dev(q, codes, torch.zeros(1, 5, 3, dtype=torch.uint8), idx))
    with pytest.raises(ValueError, match="12 bytes per entry, not a multiple of 8"):
        entries_fp4.csa2_entries_fp4(*_dev(q, codes[..., :12], scales, idx))
    with pytest.raises(ValueError, match="idx has dtype torch.int32"):
        entries_fp4.csa2_entries_fp4(*_dev(q, codes, scales, idx.int()))


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
        kv, renumbered = ops.csa2_entries_fp4(*_dev(q, codes, scales, idx))
        rows = s * k if form == "selected" or (form == "auto" and s * k < n) else n
        assert kv.shape == (b, rows, d) and torch.equal(renumbered.cpu() < 0, idx < 0)
        got = ops.csa2_sparse_attention(*_dev(q, kv, renumbered, win, wmask, sink), d ** -0.5)
        assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, dtype,
                              f"attention over FP4 entries ({backend}, {form})")
        fused = ops.csa2_sparse_attention_fp4(*_dev(q, codes, scales, idx, win, wmask, sink), d ** -0.5)
        assert_kernel_matches(fused, attn_ref.csa2_sparse_attention, args, {}, dtype,
                              f"OpSet.csa2_sparse_attention_fp4 ({backend}, {form})")
    with pytest.raises(ValueError, match="unknown entry form 'some'"):
        OpSet("reference", entry_form="some")

