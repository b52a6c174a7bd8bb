"""The block-max form's launches before the rank in one program per row, for rows that fit it
(StableTopkLauncher._pass_launch "row": a listed pool's 16K scores, 2,048 blocks of 8).

prefilter.py runs three launches before its rank: block maxima with the first digit pass, the
other passes (maxima_passes_kernel), the collect. At 32 rows of a listed pool their work is small
and each boundary costs a few microseconds: under the profiler on an H100 they ended 4.1, 5.5 and
4.7 us after the launch before (docs/benchmarks.md, session 48). Here one program per row reads
the row's scores once into registers ([MP, BLOCK]: 64 a thread at 8 warps), takes the maxima, runs
every digit pass over them (with maxima_passes_kernel's early stop) and keys the entries above the
threshold straight from its registers into the candidate list, with no atomics: the program owns
the row, so the slots come from a scan over its MP block counts, and the count is stored.

What session 37's one-program form taught (docs/benchmarks.md, "Measured and dropped: a top-k in
one program per row"): scans and sums over a whole [16384] row in Triton cost microseconds each
(each crosses warps through shared memory), and a rank of 262K pairs in one program is slower
still. So this program scans only the MP block counts (the count within a block is a scan over
BLOCK entries a thread or two hold), and the rank stays a launch over all SMs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsflash.plugins.pdl import wait_for_earlier_grids
from dsflash.plugins.stable_topk.keys import BIG, narrow_by_count, order_key, order_key32
from dsflash.plugins.stable_topk.prefilter import later_passes


@triton.jit
def row_collect_kernel(scores_ptr, N, k, bm_ptr, counter, prog_eq, cand, tval, CAP, WIDTHS: tl.constexpr,
                       MP: tl.constexpr, BLOCK: tl.constexpr, SLACK: tl.constexpr, CHUNK: tl.constexpr,
                       PP: tl.constexpr, STEP: tl.constexpr, HIST_BINS: tl.constexpr,
                       PASSES: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (rows,), rows of N <= MP x BLOCK scores: what prefilter.py's launches before the rank
    leave for prefilter_rank_kernel. tval[row] the threshold t (T, the k-th best block maximum's
    key, or with SLACK >= 0 the key below the digit the passes stopped at:
    prefilter.maxima_passes_kernel); the entries with keys above t into cand[row, :CAP] as full
    keys (score key, reversed index) and their count into counter[row]; where that count is below
    k (t = T: fewer than k entries above it), each CHUNK's count of entries equal to T into
    prog_eq[row, :cdiv(N, CHUNK)] (PP >= that many chunks) for the rank launch's ties."""
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, MP)
    n = j[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = n < N
    s = tl.load(scores_ptr + row * N + n, mask=ok, other=-BIG)  # -BIG: a padded entry raises no maximum
    live = j * BLOCK < N
    # the maxima through memory: held as the tile's slice, each is in two threads and the passes'
    # histograms over them compile to ~6x the code (sm_90: 17,328 SASS instructions and 255
    # registers for the passes alone against maxima_passes_kernel's 2,720 and 75)
    tl.store(bm_ptr + row * MP + j, tl.max(s, axis=1))
    tl.debug_barrier()
    key = order_key(tl.load(bm_ptr + row * MP + j, cache_modifier=".cg"))  # order_key clamps as the sort
    bits0: tl.constexpr = WIDTHS & 15
    digit = ((key >> (32 - bits0)) & ((1 << bits0) - 1)).to(tl.int32)
    h = tl.histogram(digit, HIST_BINS, mask=live)
    prefix, k_rem, in_d = narrow_by_count(h, tl.zeros([], dtype=tl.int64), tl.zeros([], dtype=tl.int64) + k,
                                          HIST_BINS, bits0)
    t = later_passes(key, live, prefix, k_rem, in_d, k, CAP, WIDTHS, BLOCK, SLACK, HIST_BINS, PASSES)
    tl.store(tval + row, t)
    # 32-bit compares against t (every key is >= 1, so a t of -1 reads as 0: nothing below it).
    # The collect steps over STEP blocks at a time: the whole row's keys, slots and full keys at
    # once take over 255 registers a thread and spill (sm_90)
    t32 = tl.maximum(t, 0).to(tl.uint32)
    g = tl.zeros([], dtype=tl.int32)
    for b0 in tl.range(0, MP, STEP):
        jb = b0 + tl.arange(0, STEP)
        nb = jb[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        okb = nb < N
        # the scores again, from L1 (the row's 64 KB were just read): held through the passes
        # they would take 64 registers a thread
        entry_key = order_key32(tl.load(scores_ptr + row * N + nb, mask=okb, other=0.0))
        gt = (okb & (entry_key > t32)).to(tl.int32)
        per_block = tl.sum(gt, axis=1)
        slot = g + (tl.cumsum(per_block, axis=0) - per_block)[:, None] + tl.cumsum(gt, axis=1) - 1
        full = ((entry_key.to(tl.int64) & 0xFFFFFFFF) << 32) | (0xFFFFFFFF - nb.to(tl.int64))
        # slot < CAP always holds for finite scores (as prefilter_collect_kernel's)
        tl.store(cand + row * CAP + slot, full.to(tl.uint64), mask=(gt != 0) & (slot < CAP))
        g += tl.sum(per_block, axis=0)
    tl.store(counter + row, g)
    if g < k:
        # ties at T counted per CHUNK, as the collect launches leave them: a histogram of the
        # tied entries' chunk numbers (bin PP takes every other entry; order does not matter)
        n_chunks = tl.cdiv(N, CHUNK)
        eq = tl.zeros([2 * PP], dtype=tl.int32)
        for b0 in tl.range(0, MP, STEP):
            nb = (b0 + tl.arange(0, STEP))[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
            okb = nb < N
            tied = okb & (order_key32(tl.load(scores_ptr + row * N + nb, mask=okb, other=0.0)) == t32)
            chunk_of = tl.where(tied, nb // CHUNK, PP)
            eq += tl.histogram(tl.reshape(chunk_of, [STEP * BLOCK], can_reorder=True), 2 * PP)
        c = tl.arange(0, 2 * PP)
        tl.store(prog_eq + row * n_chunks + c, eq, mask=c < n_chunks)
