"""Stable top-k, block-max form: the radix select runs over the maxima of blocks of BLOCK
entries instead of over every entry, and only the entries it leaves can be among the k best.

Why it is exact. Let T be the k-th largest block maximum (counted with multiplicity) and v the
k-th best score. At least k blocks have a maximum >= T, each holding an entry >= T, so v >= T:
every one of the k best is >= T. At most k - 1 blocks have a maximum above T, so at most
(k - 1) x BLOCK entries are above T (G of them). If G >= k, the k best are the k best of those G;
otherwise v = T, and the k best are the G entries above T and then the first k - G entries equal
to T in index order, the reference's tie rule.

Launches (grid (rows, programs) each, none waiting for another inside a launch):
1. block_max_pass_kernel: the block maxima of each row (written, clamped as the reference sorts)
   and the first digit pass of the radix select over them;
2. the other digits over the maxima, giving T: one program per row for all of them
   (maxima_passes_kernel, where a row's maxima fit one program: a listed pool's 2,048; it may stop
   at a threshold below T once a digit holds few blocks more than it needs, see there), else
   kernel.py's radix_digit_pass_kernel, a launch per digit. Where the listed index kernel wrote
   the maxima with the scores (StableTopkLauncher.listed_ids_with_maxima), launch 1 does not run
   and this program does the first pass too;
3. prefilter_collect_live_kernel (from 2 rows) or prefilter_collect_kernel (one row): the
   entries above T into a candidate list (slots from a relaxed atomic counter, unordered) and each
   chunk's count of entries equal to T; the live form reads only the blocks whose maximum is >= T
   (about k of a row's blocks), the other every score;
4. prefilter_rank_kernel: each candidate's place is the count of candidates above it (score,
   then lower index: unique keys), written where it is below k; when G < k, programs over the
   chunks (or, with TIES_IN_RANK, the rank programs after their ranks) write the first k - G
   entries equal to T in index order after them.

The digit passes read M = N / BLOCK maxima instead of N scores: at a decode batch, where the
radix form's passes are bound by their histograms' work per entry, this saves most of it. The
rank compares G candidates with each other (G^2; G is near k for scores without long runs of
high values, and at most (k - 1) x BLOCK).

The first launch clears the slot counter and the last one the histograms, for the next call
(CUDA-graph replay). NaN scores are not checked, as in the radix form.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsflash.plugins.pdl import wait_for_earlier_grids
from dsflash.plugins.stable_topk.keys import (
    BIG,
    chunk_keys,
    clear_histograms,
    narrow_by_count,
    narrowed,
    narrowed_count,
    order_key,
    ordered_keys,
    pad_listed_row,
    place_among,
    write_picks,
)


@triton.jit
def block_max_pass_kernel(scores_ptr, N, M, k, hist, state, counter, bm_ptr, SHIFT: tl.constexpr,
                          BITS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                          HIST_BINS: tl.constexpr, PASSES: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (rows, cdiv(M, CHUNK)): the maxima bm[row, :M] of CHUNK blocks of BLOCK scores
    (clamped to +-float32 max) and their first digit (at SHIFT) histogrammed into hist[row, 0];
    state[row, 0] = (0, k) and the row's slot counter back to 0, by the row's first program."""
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    j = p * CHUNK + tl.arange(0, CHUNK)
    n = j[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    s = tl.load(scores_ptr + row * N + n, mask=n < N, other=-BIG)
    top = tl.max(tl.minimum(tl.maximum(s, -BIG), BIG), axis=1)
    live = j < M
    tl.store(bm_ptr + row * M + j, top, mask=live)
    if p == 0:
        zero = tl.zeros([], dtype=tl.int64)
        tl.store(state + row * PASSES * 2, zero)
        tl.store(state + row * PASSES * 2 + 1, zero + k)
        tl.store(counter + row, zero.to(tl.int32))
    BINS: tl.constexpr = 1 << BITS
    digit = ((order_key(top) >> SHIFT) & (BINS - 1)).to(tl.int32)
    h = tl.histogram(digit, BINS, mask=live)
    tl.atomic_add(hist + row * PASSES * HIST_BINS + tl.arange(0, BINS), h, mask=h > 0, sem="relaxed")


@triton.jit
def maxima_passes_kernel(bm_ptr, M, k, hist, state, tval, CAP, counter, WIDTHS: tl.constexpr,
                         MP: tl.constexpr, BLOCK: tl.constexpr, SLACK: tl.constexpr, HIST_BINS: tl.constexpr,
                         PASSES: tl.constexpr, FIRST: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid (rows,): digit passes 1 .. PASSES - 1 over a row's M block maxima bm[row, :M] in one
    program, in place of a launch per pass: each launch boundary of that chain cost ~2-4 us while
    its work over 2,048 maxima is a few histograms (H100, a listed pool at 32 rows: passes 1-3
    ended 8.0 us after the maxima; docs/benchmarks.md, session 46). WIDTHS packs the passes'
    digit widths 4 bits each, pass i at bit 4i. Pass 0's histogram comes from
    block_max_pass_kernel. It writes the collect launch's threshold t to tval[row] (the collect
    keeps the entries with keys above t): T, the k-th best maximum's key, after every pass; or,
    with SLACK >= 0, it stops after the first pass that leaves the k-th best maximum in a digit of
    at most SLACK blocks more than the k_rem it needs there, whose blocks' entries fit the
    candidate list of CAP, and t is the key just below that digit's range.

    Why stopping there is exact: with t below T, the entries above t include every entry >= T, at
    least k of them (at least k blocks have a maximum >= T), so the list holds at least k
    candidates and the rank picks the k best of them: no ties at t are needed. The list holds
    entries of the (k - k_rem) blocks above the digit and its in_d blocks only, at most
    (k - k_rem + in_d) x BLOCK of them. On a listed pool's random scores the second pass (16 bits
    of the key) leaves a few maxima in the digit: one pass in this program instead of three, and
    a few more candidates to rank.

    FIRST: pass 0 as well, over maxima that the index kernel wrote with the scores
    (csa2_index_score_pooled_maxima), where no block_max_pass_kernel ran: its histogram in
    registers, and the row's slot counter back to 0 for the collect. A launch less between the
    index kernel and the collect."""
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, MP)
    live = j < M
    key = order_key(tl.load(bm_ptr + row * M + j, mask=live, other=0.0, cache_modifier=".cg"))
    if FIRST:
        top_bits: tl.constexpr = WIDTHS & 15
        digit = ((key >> (32 - top_bits)) & ((1 << top_bits) - 1)).to(tl.int32)
        start = tl.zeros([], dtype=tl.int64)
        prefix, k_rem, in_d = narrow_by_count(tl.histogram(digit, HIST_BINS, mask=live), start, start + k,
                                              HIST_BINS, top_bits)
        tl.store(counter + row, start.to(tl.int32))
    else:
        prefix, k_rem, in_d = narrowed_count(hist, state, row, 0, WIDTHS & 15, HIST_BINS, PASSES)
    rem = tl.zeros([], dtype=tl.int64) + (32 - (WIDTHS & 15))  # key bits below the prefix
    shift = 32 - (WIDTHS & 15)
    for i in tl.static_range(1, PASSES):
        bits = (WIDTHS >> (4 * i)) & 15
        shift = shift - bits
        go = rem > 0
        if SLACK >= 0:
            go = go & ((in_d - k_rem > SLACK) | ((k - k_rem + in_d) * BLOCK > CAP))
        if go:
            play = live & ((key >> (shift + bits)) == prefix)
            digit = ((key >> shift) & ((1 << bits) - 1)).to(tl.int32)
            h = tl.histogram(digit, HIST_BINS, mask=play)
            prefix, k_rem, in_d = narrow_by_count(h, prefix, k_rem, HIST_BINS, bits)
            rem = rem - bits
    tl.store(tval + row, tl.where(rem > 0, (prefix << rem) - 1, prefix))


@triton.jit
def collect_threshold(hist, state, tval, row, p, LAST_BITS: tl.constexpr, HIST_BINS: tl.constexpr,
                      PASSES: tl.constexpr, T_GIVEN: tl.constexpr):
    """The collect launches' threshold: T_GIVEN, the one maxima_passes_kernel wrote to tval[row];
    else T from the last digit pass's histogram, written to tval[row] by the row's first program
    for the rank launch."""
    if T_GIVEN:
        t = tl.load(tval + row, cache_modifier=".cg")
    else:
        t, _ = narrowed(hist, state, row, PASSES - 1, LAST_BITS, HIST_BINS, PASSES)
        if p == 0:
            tl.store(tval + row, t)
    return t


@triton.jit
def prefilter_collect_kernel(scores_ptr, N, hist, state, counter, prog_eq, cand, tval, CAP,
                             CHUNK: tl.constexpr, LAST_BITS: tl.constexpr, HIST_BINS: tl.constexpr,
                             PASSES: tl.constexpr, T_GIVEN: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid (rows, chunks): T from the last digit pass over the maxima (into tval[row] for the
    rank launch; T_GIVEN: the threshold maxima_passes_kernel left there), the entries above T into
    cand[row, :CAP] as keys (score key, reversed index), and the chunk's count of entries equal to
    T into prog_eq[row, chunk]."""
    wait_for_earlier_grids(PDL)
    row, p, n_prog, n, ok, key = chunk_keys(scores_ptr, N, CHUNK)
    t = collect_threshold(hist, state, tval, row, p, LAST_BITS, HIST_BINS, PASSES, T_GIVEN)
    gt = ok & (key > t)
    tl.store(prog_eq + row * n_prog + p, tl.sum((ok & (key == t)).to(tl.int32), axis=0))
    n_mine = tl.sum(gt.to(tl.int32), axis=0)
    base = tl.atomic_add(counter + row, n_mine, mask=n_mine > 0, sem="relaxed")  # a run of slots
    slot = base + tl.cumsum(gt.to(tl.int32), axis=0) - 1
    full = ((key << 32) | (0xFFFFFFFF - n.to(tl.int64))).to(tl.uint64)  # unique: best, then lowest index
    # slot < CAP always holds for finite scores (at most (k - 1) x BLOCK above T); the mask keeps
    # NaN scores from writing past the list
    tl.store(cand + row * CAP + slot, full, mask=gt & (slot < CAP))


@triton.jit
def prefilter_collect_live_kernel(scores_ptr, N, M, bm_ptr, live_ptr, hist, state, counter, prog_eq, cand, tval,
                                  CAP, CHUNK: tl.constexpr, BLOCK: tl.constexpr, LIVE_BLOCKS: tl.constexpr,
                                  LAST_BITS: tl.constexpr, HIST_BINS: tl.constexpr, PASSES: tl.constexpr,
                                  T_GIVEN: tl.constexpr = False, PDL: tl.constexpr = False):
    """prefilter_collect_kernel's outputs (same grid, same CHUNK) from the live blocks only: those
    whose maximum is >= T, since every entry >= T lies in one. A program reads its CHUNK / BLOCK
    maxima, lists its live blocks' numbers in live_ptr[row, p * CHUNK / BLOCK:] (its own part of a
    [rows, M] buffer: the k-th live block of the chunk is at most its k-th block), then reads and
    keys LIVE_BLOCKS of them at a time. About k of a row's M blocks are live on scores without long
    runs of equal best values, so a row of 128K reads ~1/16 of its scores and keys as many."""
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    n_prog = tl.num_programs(1)
    t = collect_threshold(hist, state, tval, row, p, LAST_BITS, HIST_BINS, PASSES, T_GIVEN)
    NB: tl.constexpr = CHUNK // BLOCK
    j = p * NB + tl.arange(0, NB)
    top = tl.load(bm_ptr + row * M + j, mask=j < M, other=0.0, cache_modifier=".cg")
    live = (j < M) & (order_key(top) >= t)
    n_live = tl.sum(live.to(tl.int32), axis=0)
    mine = live_ptr + row * M + p * NB
    tl.store(mine + tl.cumsum(live.to(tl.int32), axis=0) - 1, j, mask=live)
    tl.debug_barrier()  # the list is written (and visible to the whole program) before it is read
    n_eq = tl.zeros([], dtype=tl.int32)
    for s in tl.range(0, n_live, LIVE_BLOCKS):
        slot_b = s + tl.arange(0, LIVE_BLOCKS)
        has = slot_b < n_live
        b = tl.load(mine + slot_b, mask=has, other=0, cache_modifier=".cg")
        n = b[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        ok = has[:, None] & (n < N)
        key = ordered_keys(scores_ptr, row, n, ok, N)
        gt = (ok & (key > t)).to(tl.int32)
        n_eq += tl.sum(tl.sum((ok & (key == t)).to(tl.int32), axis=1), axis=0)
        per_block = tl.sum(gt, axis=1)
        n_mine = tl.sum(per_block, axis=0)
        base = tl.atomic_add(counter + row, n_mine, mask=n_mine > 0, sem="relaxed")  # a run of slots
        slot = base + (tl.cumsum(per_block, axis=0) - per_block)[:, None] + tl.cumsum(gt, axis=1) - 1
        full = ((key << 32) | (0xFFFFFFFF - n.to(tl.int64))).to(tl.uint64)  # as prefilter_collect_kernel's
        tl.store(cand + row * CAP + slot, full, mask=(gt != 0) & (slot < CAP))
    tl.store(prog_eq + row * n_prog + p, n_eq)


@triton.jit
def _write_ties(scores_ptr, vals_ptr, idx_ptr, prog_eq, tval, row, N, k, g, need, c, n_chunks,
                entries_ptr, W, CHUNK: tl.constexpr, PP: tl.constexpr, LISTED: tl.constexpr,
                TIE_STEP: tl.constexpr):
    """Chunk c's entries equal to T among the first `need` of them in index order (the chunks
    before it hold prog_eq of them each), written at places g and on, TIE_STEP entries at a time
    (a divisor of CHUNK: the registers the path holds, which the whole rank program is given
    whether or not a row has ties)."""
    pp = tl.arange(0, PP)
    counts = tl.load(prog_eq + row * n_chunks + pp, mask=pp < c, other=0, cache_modifier=".cg")
    before = tl.sum(counts, axis=0)
    if before < need:
        t = tl.load(tval + row, cache_modifier=".cg")
        for s in tl.range(0, CHUNK, TIE_STEP):
            n = c * CHUNK + s + tl.arange(0, TIE_STEP)
            ok = n < N
            eq = ok & (ordered_keys(scores_ptr, row, n, ok, N) == t)
            eq_rank = before + tl.cumsum(eq.to(tl.int32), axis=0) - 1
            put = eq & (eq_rank < need)
            write_picks(scores_ptr, vals_ptr, idx_ptr, row, N, k, g + eq_rank, n.to(tl.int64), put,
                        entries_ptr, W, LISTED)
            before += tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def prefilter_rank_kernel(scores_ptr, N, k, hist, counter, prog_eq, cand, tval, vals_ptr, idx_ptr, CAP,
                          entries_ptr, W, RANK_PROGS: tl.constexpr, RANK_BLOCK: tl.constexpr,
                          CMP_BLOCK: tl.constexpr, CHUNK: tl.constexpr, PP: tl.constexpr,
                          HIST_BINS: tl.constexpr, PASSES: tl.constexpr, TIES_IN_RANK: tl.constexpr = False,
                          LISTED: tl.constexpr = False, PDL: tl.constexpr = False,
                          RANK_TILE: tl.constexpr = False, RANK_AHEAD: tl.constexpr = False,
                          TIE_STEP: tl.constexpr = 0):
    """Grid (rows, RANK_PROGS + chunks), or (rows, RANK_PROGS) with TIES_IN_RANK. The first
    RANK_PROGS programs of a row take its G candidates RANK_BLOCK at a time (strided) and write
    each one whose place (candidates above it) is below k. When G < k, the entries equal to T among
    the first k - G of them in index order go to places G and on: written by one program per chunk
    of the scores after the rank programs, or with TIES_IN_RANK by the rank programs themselves,
    each taking every RANK_PROGS-th chunk after its ranks (no program of the launch is there for
    the ties alone; most rows have G >= k). The row's first program clears the histograms for the
    next call (this launch does not read them). LISTED: entry ids out (keys.write_picks), the
    row's columns past k padded by its first program. RANK_TILE / RANK_AHEAD: keys.place_among's
    TILE / AHEAD. TIE_STEP: entries of a chunk the tie path reads at a time (_write_ties; 0: the
    whole CHUNK)."""
    STEP: tl.constexpr = CHUNK if TIE_STEP == 0 else TIE_STEP
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    q = tl.program_id(1)
    g = tl.minimum(tl.load(counter + row, cache_modifier=".cg"), CAP)
    if q < RANK_PROGS:
        for start in tl.range(q * RANK_BLOCK, g, RANK_PROGS * RANK_BLOCK):
            r = start + tl.arange(0, RANK_BLOCK)
            keep = r < g
            mine = tl.load(cand + row * CAP + r, mask=keep, other=0, cache_modifier=".cg")
            rank = place_among(mine, cand + row * CAP, g, CMP_BLOCK, RANK_TILE, RANK_AHEAD)
            write_picks(scores_ptr, vals_ptr, idx_ptr, row, N, k, rank,
                        (0xFFFFFFFF - (mine & 0xFFFFFFFF)).to(tl.int64), keep & (rank < k), entries_ptr, W,
                        LISTED)
        if q == 0:
            clear_histograms(hist, row, HIST_BINS, PASSES)
            pad_listed_row(idx_ptr, row, k, W, LISTED)
        if TIES_IN_RANK:
            need = k - g
            if need > 0:
                n_chunks = tl.cdiv(N, CHUNK)  # the collect launch's grid: no tie programs here
                for c in tl.range(q, n_chunks, RANK_PROGS):
                    _write_ties(scores_ptr, vals_ptr, idx_ptr, prog_eq, tval, row, N, k, g, need, c, n_chunks,
                                entries_ptr, W, CHUNK, PP, LISTED, STEP)
    else:
        need = k - g
        if need > 0:
            _write_ties(scores_ptr, vals_ptr, idx_ptr, prog_eq, tval, row, N, k, g, need, q - RANK_PROGS,
                        tl.num_programs(1) - RANK_PROGS, entries_ptr, W, CHUNK, PP, LISTED, STEP)
