"""The stable top-k kernels (plugins/stable_topk) against the stable sort, bit for bit, on small
irregular rows: both forms (radix digits over the scores; the block-max form's passes over block
maxima, rank programs and collect launches), listed pools' ids, every launch option the defaults
or the sweeps take, ties, -inf / +inf and -0.0, and workspaces left clear for the next call (a
CUDA-graph replay). Without CUDA the kernels run in the Triton interpreter (conftest); on the GPU
the same tests run for real (scripts/gpu_check.sh). Split from test_kernels.py (2026-12-08): its
top-k third ran alone on one CI worker.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import on_device

triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
import triton.language as tl  # noqa: E402

from dsflash.plugins.stable_topk.keys import place_among  # noqa: E402
from dsflash.plugins.stable_topk.reference import block_maxima  # noqa: E402


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
        got = launcher.listed_ids(*on_device(scores, entries), k, n)
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
        got = launcher.listed_ids_with_maxima(*on_device(scores, block_maxima(scores, 2), entries), k, n)
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
        small.listed_ids_with_maxima(*on_device(scores, block_maxima(scores, 2)[..., :31], entries), 8, 500)
    with pytest.raises(ValueError, match="2 rows of 64 scores at k = 8 take no block maxima"):
        on.listed_ids_with_maxima(*on_device(scores, block_maxima(scores, 2), entries), 8, 500)


def test_stable_topk_listed_ids_refuse_bad_input(gen):
    """Entries of another shape or dtype, a list longer than the entries it lists from (its k
    picks past min(k, n) columns), scores not [B, S, P]: a ValueError naming them before any
    launch."""
    from dsflash.plugins.stable_topk.kernel import StableTopkLauncher

    scores, entries = _listed_case(gen, 2, 64, 40, 500)
    launcher = StableTopkLauncher()
    with pytest.raises(ValueError, match=r"entries \(2, 1, 63\) must match the scores \(2, 1, 64\)"):
        launcher.listed_ids(*on_device(scores, entries[..., :63]), 8, 500)
    with pytest.raises(ValueError, match="entries has dtype torch.float32"):
        launcher.listed_ids(*on_device(scores, entries.float()), 8, 500)
    with pytest.raises(ValueError, match="a list of 64 entries over n = 7: the top-k's 8 columns exceed"):
        launcher.listed_ids(*on_device(scores, entries), 8, 7)
    with pytest.raises(ValueError, match="scores"):
        launcher.listed_ids(*on_device(scores[:, 0], entries[:, 0]), 8, 500)
@pytest.mark.parametrize("digits", [(8, 8, 8), (12, 10, 10), (0, 16, 16)])
def test_stable_topk_rejects_bad_digit_schedules(digits):
    """A digit schedule that does not cover the 32-bit key, or has a digit the kernel cannot hold,
    is refused before any launch, naming the widths."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel

    launcher = topk_kernel.StableTopkLauncher(overrides={"DIGITS": digits})
    with pytest.raises(ValueError, match=r"digit widths .* 1\.\.11 bits each and add up to 32"):
        launcher(*on_device(torch.rand(1, 100)), 4)


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
        got_v, got_i = launcher(*on_device(scores), k)
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
        got_v, got_i = launcher(*on_device(scores), k)
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
        got_v, got_i = launcher(*on_device(scores), k)
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


def _check_block_max_cases(launcher, gen, block: int | None = None) -> None:
    """Every bound case in turn on one launcher, then the first case again, each against the
    stable sort bit for bit: a count, histogram or list that one call leaves behind shows in the
    next call's other rows (the same rows twice could pick the same entries over stale state).
    Each call must leave its histograms cleared; with `block`, the launcher must take the
    block-max form in blocks of `block`."""
    from dsflash.plugins.stable_topk import reference as topk_ref

    cases = _block_max_cases(gen)
    for name in (*cases, next(iter(cases))):
        scores, k = cases[name]
        if block is not None:
            assert launcher._form(scores.shape[-1], k, block, scores.shape[0]) == ("prefilter", block)
        want_v, want_i = topk_ref.stable_topk(scores, k)
        got_v, got_i = launcher(*on_device(scores), k)
        assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v), name
        _assert_topk_workspaces_cleared(launcher)  # for the next call (CUDA-graph replay)


@pytest.mark.parametrize("block", [2, 8, 32])
@pytest.mark.parametrize("pass_launch", ["fused", "each", "fused-4-warps"])
def test_stable_topk_block_max_form_is_exact_at_its_bounds(gen, block, pass_launch):
    """The block-max form against the stable sort, bit for bit, where it works hardest: the k best
    in the last blocks (the most entries above the k-th block maximum, (k - 1) x BLOCK, several
    strides of the rank programs), ties of the k-th best spread over chunks (written after the
    entries above it, in index order), a run of equal best scores, all equal, all -inf; one
    launcher for all of them, so a stale count or histogram would show; the digit passes over the
    maxima in one program per row (4 and 8 warps) and in a launch each."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel

    launcher = topk_kernel.StableTopkLauncher(overrides={"FORM": "prefilter", "BLOCK": block, "CHUNK": 256,
                                                         "RANK_BLOCK": 2, "PASS_LAUNCH": pass_launch[:5],
                                                         "PASS_WARPS": 4 if "4" in pass_launch else 8})
    _check_block_max_cases(launcher, gen, block)


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
def test_stable_topk_block_max_collect_forms_are_exact(gen, over):
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
    carrying the count of ties from step to step. One launcher takes the cases in turn."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel

    launcher = topk_kernel.StableTopkLauncher(overrides={"FORM": "prefilter", "BLOCK": 8, "CHUNK": 256} | over)
    _check_block_max_cases(launcher, gen)


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
        got_v, got_i = launcher(*on_device(scores), kk)
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
        got_v, got_i = launcher(*on_device(scores), 8)
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
        StableTopkLauncher(overrides={"CHUNK": 100})(*on_device(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="BLOCK must be a power of two in 2..512, got 12"):
        StableTopkLauncher(overrides={"BLOCK": 12})(*on_device(torch.rand(2, 4096)), 8)  # before any launch
    with pytest.raises(ValueError, match="COLLECT must be 'live' or 'chunk', got 'all'"):
        StableTopkLauncher(overrides={"COLLECT": "all"})(*on_device(torch.rand(1, 4096)), 8)
    with pytest.raises(ValueError, match="LIVE_BLOCKS must be a power of two or 'rounds', got 3"):
        StableTopkLauncher(overrides={"LIVE_BLOCKS": 3})(*on_device(torch.rand(1, 4096)), 8)
    for name, bad in (("RANK_BLOCK", 6), ("CMP_BLOCK", 0)):
        for scores in (torch.rand(2, 4096), torch.rand(2, 300)):  # the block-max and the radix form
            with pytest.raises(ValueError, match=f"{name} must be a power of two, got {bad}"):
                StableTopkLauncher(overrides={name: bad})(*on_device(scores), 8)
    with pytest.raises(ValueError, match="BM_CHUNK must be a power of two, got 24"):
        StableTopkLauncher(overrides={"BM_CHUNK": 24, "FORM": "prefilter"})(*on_device(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="TIES must be 'chunk' or 'rank', got 'all'"):
        StableTopkLauncher(overrides={"TIES": "all", "FORM": "prefilter"})(*on_device(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="PASS_WARPS must be a power of two, got 6"):
        StableTopkLauncher(overrides={"PASS_WARPS": 6, "FORM": "prefilter"})(*on_device(torch.rand(2, 4096)), 8)
    for name in ("BM_WARPS", "COLLECT_WARPS"):
        with pytest.raises(ValueError, match=f"{name} must be a power of two, got 5"):
            StableTopkLauncher(overrides={name: 5, "FORM": "prefilter"})(*on_device(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="RANK_WARPS must be a power of two, got 3"):
        StableTopkLauncher(overrides={"RANK_WARPS": 3, "FORM": "prefilter"})(*on_device(torch.rand(2, 4096)), 8)
    for name in ("RANK_TILE", "RANK_AHEAD"):
        with pytest.raises(ValueError, match=f"{name} must be True or False, got 1"):
            StableTopkLauncher(overrides={name: 1, "FORM": "prefilter"})(*on_device(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="TIE_STEP must be a power of two, got 48"):
        StableTopkLauncher(overrides={"TIE_STEP": 48, "FORM": "prefilter"})(*on_device(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="RANK_COVER must be 1, 2 or 4, got 3"):
        StableTopkLauncher(overrides={"RANK_COVER": 3, "FORM": "prefilter"})(*on_device(torch.rand(2, 4096)), 8)
    with pytest.raises(ValueError, match="PASS_LAUNCH must be 'fused' or 'each', got 'one'"):
        StableTopkLauncher(overrides={"PASS_LAUNCH": "one", "FORM": "prefilter"})(*on_device(torch.rand(2, 4096)),
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
    got_v, got_i = launcher(*on_device(scores), 24)
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
        m, k_, o = on_device(mine.view(torch.uint64), keys.view(torch.uint64), out)  # as the candidates are
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
    got_v, got_i = launcher(*on_device(scores), 40)
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
        got_v, got_i = launcher(*on_device(scores), k)
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
            StableTopkLauncher(overrides={"EARLY_SLACK": bad, "FORM": "prefilter"})(*on_device(torch.rand(2, 4096)), 8)


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
