"""Stable top-k, row form: one program per row holds the whole row (up to ROW_MAX_N entries) in
registers and does every step in one launch.

At a decode batch a Reindex layer's listed pool gives rows of 16K scores (k = 512). The radix form
(kernel.py) spends six launches on them, each with a program per 512 entries adding its histogram
into the row's with atomics: 43.1 us at 64 rows on the H200 (session 36), against 10.9 us for one
row, so the launches do not run side by side. Here a row's whole select runs inside one program,
and the rows run side by side on the SMs (one wave up to one row per SM).

Steps of a program (the radix form's, without the global histograms):
1. order keys of the row's scores (keys.py, 32 bits; masked entries are not in play);
2. digit passes of BITS bits over the entries still in play (those whose key bits above the
   digit equal the prefix found so far), each a tl.histogram: the digit holding the k_rem-th best
   entry extends the prefix. The passes stop once the entries in play are exactly the k_rem still
   to find (all of them are taken: on continuous scores after a few passes), or when all 32 bits
   are found (exact ties of the k-th best key);
3. one scan over the row gives each entry above the prefix its slot, and each entry at the prefix
   its place in index order; the k picks go, unsorted, to a [KP] scratch row (key, index);
4. after a barrier, each pick's place in the output is the count of picks above it (key, then
   lower index: unique), as the radix form's rank pass counts, and index and value go there.

No counters or histograms outlive a call, so the launch captures into a CUDA graph as it is.
NaN scores are not checked, as in the other forms.

Why keys stay 32 bits here: a [16384] tensor over 32 warps is 16 registers per thread per 32-bit
value, and a program of 1,024 threads has at most 64 registers each; the picks are stored as key
and index apart and joined into the 64-bit rank keys only for the k picks.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsflash.plugins.pdl import wait_for_earlier_grids
from dsflash.plugins.stable_topk.keys import order_key32, write_picks


@triton.jit
def _prefix_of_kth(key, ok, kk, N, BITS: tl.constexpr):
    """(shift, prefix, k_rem): the key bits above `shift` shared by the entries still in play and
    the count of the k best still to find among them, after the digit passes (step 2)."""
    BINS: tl.constexpr = 1 << BITS
    b = tl.arange(0, BINS)
    zero = tl.zeros([], dtype=tl.int32)
    shift = zero + 32
    prefix = zero.to(tl.uint32)
    k_rem = zero + kk
    left = zero + N  # entries in play
    while (shift > 0) & (left > k_rem):
        low = tl.maximum(shift - BITS, 0)
        width = shift - low
        # key >> shift in two steps: a shift by 32 would be undefined
        play = ok & (((key >> (shift - 1).to(tl.uint32)) >> 1) == prefix)
        digit = ((key >> low.to(tl.uint32)) & ((1 << width) - 1).to(tl.uint32)).to(tl.int32)
        h = tl.histogram(digit, BINS, mask=play)
        at_or_above = left - tl.cumsum(h, axis=0) + h  # entries in play with digit >= b
        above = at_or_above - h
        d = tl.max(tl.where((above < k_rem) & (at_or_above >= k_rem), b, -1), axis=0)
        k_rem -= tl.sum(tl.where(b == d, above, 0), axis=0)
        left = tl.sum(tl.where(b == d, h, 0), axis=0)
        prefix = (prefix << width.to(tl.uint32)) | d.to(tl.uint32)
        shift = low
    return shift, prefix, k_rem


@triton.jit
def _picks_into(key, index, ok, k, count, sel_key, sel_idx, row, KP: tl.constexpr, BITS: tl.constexpr):
    """Steps 2 and 3 over a set of entries (their keys, entry indices, mask; `count` of them, in
    index order): their k best into sel_key / sel_idx[row, :k], unsorted."""
    shift, prefix, k_rem = _prefix_of_kth(key, ok, k, count, BITS)
    # the key bits above `shift` against the prefix (all bits when shift is 0; none, so every entry
    # is at the prefix, when no pass ran because k >= count)
    adj = tl.minimum(shift, 1)
    hi = (key >> (shift - adj).to(tl.uint32)) >> adj.to(tl.uint32)
    gt = ok & (hi > prefix)
    eq = ok & (hi == prefix)
    # one scan for both counts: fewer than 2^16 entries, and fewer than k <= 2^13 above the prefix
    both = tl.cumsum(gt.to(tl.int32) * 65536 + eq.to(tl.int32), axis=0)
    slot = tl.where(gt, (both >> 16) - 1, k - k_rem + (both & 0xFFFF) - 1)
    put = gt | (eq & ((both & 0xFFFF) <= k_rem))
    tl.store(sel_key + row * KP + slot, key, mask=put)
    tl.store(sel_idx + row * KP + slot, index, mask=put)


@triton.jit
def row_topk_kernel(scores_ptr, N, k, sel_key, sel_idx, cand_key, cand_idx, vals_ptr, idx_ptr,
                    KP: tl.constexpr, NP: tl.constexpr, BITS: tl.constexpr, CMP_BLOCK: tl.constexpr,
                    BLOCK: tl.constexpr, CAP: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (rows,). scores [rows, N] (N <= NP) -> vals / idx [rows, k] (k = min(k, N), <= KP),
    the stable sort's first k; sel_key / sel_idx [rows, KP]: the picks, unsorted, and cand_key /
    cand_idx [rows, CAP]: the candidates (scratch). BLOCK > 1 (needs k <= cdiv(N, BLOCK)): the
    digit passes first find T, the k-th best of the maxima of blocks of BLOCK entries, and run
    again over the entries >= T only, when at most CAP (prefilter.py's bound, in one program);
    BLOCK = 1, or more than CAP such entries: over the whole row."""
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, NP)
    ok = n < N
    key = tl.where(ok, order_key32(tl.load(scores_ptr + row * N + n, mask=ok, other=0.0)), 0)
    if BLOCK > 1:
        NB: tl.constexpr = NP // BLOCK
        n_blocks = tl.cdiv(N, BLOCK)
        top = tl.max(tl.reshape(key, [NB, BLOCK]), axis=1)  # masked entries' key 0 is below all
        shift, prefix, _ = _prefix_of_kth(top, tl.arange(0, NB) < n_blocks, k, n_blocks, BITS)
        # T: the smallest key with the prefix (at least k maxima, so k entries, are >= T)
        adj = tl.minimum(shift, 1)
        t = (prefix << (shift - adj).to(tl.uint32)) << adj.to(tl.uint32)
        cand = ok & (key >= t)
        count = tl.sum(cand.to(tl.int32), axis=0)
        if count <= CAP:
            pos = tl.cumsum(cand.to(tl.int32), axis=0) - 1  # index order
            tl.store(cand_key + row * CAP + pos, key, mask=cand)
            tl.store(cand_idx + row * CAP + pos, n, mask=cand)
            tl.debug_barrier()  # the candidates are written (and visible to the program) before they are read
            j = tl.arange(0, CAP)
            there = j < count
            _picks_into(_load_keys(cand_key + row * CAP + j, there),
                        tl.load(cand_idx + row * CAP + j, mask=there, other=0, cache_modifier=".cg"),
                        there, k, count, sel_key, sel_idx, row, KP, BITS)
        else:
            _picks_into(key, n, ok, k, N, sel_key, sel_idx, row, KP, BITS)
    else:
        _picks_into(key, n, ok, k, N, sel_key, sel_idx, row, KP, BITS)
    tl.debug_barrier()  # the picks are written (and visible to the whole program) before they are read
    # step 4
    r = tl.arange(0, KP)
    keep = r < k
    mine = _rank_key(_load_keys(sel_key + row * KP + r, keep),
                     tl.load(sel_idx + row * KP + r, mask=keep, other=0, cache_modifier=".cg"))
    place = tl.zeros([KP], dtype=tl.int32)
    for c in tl.range(0, k, CMP_BLOCK):
        j = c + tl.arange(0, CMP_BLOCK)
        there = j < k
        other = _rank_key(_load_keys(sel_key + row * KP + j, there),
                          tl.load(sel_idx + row * KP + j, mask=there, other=0, cache_modifier=".cg"))
        other = tl.where(there, other, 0)  # 0: below every pick
        place += tl.sum((other[None, :] > mine[:, None]).to(tl.int32), axis=1)
    write_picks(scores_ptr, vals_ptr, idx_ptr, row, N, k, place, n_of(mine), keep)


@triton.jit
def _load_keys(ptr, mask):
    """32-bit keys back from an int32 scratch row (0 where masked): unsigned, as order_key32 made
    them (signed, their shifts and compares would not order them)."""
    return tl.load(ptr, mask=mask, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)


@triton.jit
def _rank_key(key, index):
    """Unique 64-bit keys of picks: the score key, then the lower index first."""
    return (key.to(tl.uint64) << 32) | (0xFFFFFFFF - index.to(tl.int64)).to(tl.uint64)


@triton.jit
def n_of(full):
    """The entry index a rank key holds."""
    return (0xFFFFFFFF - (full & 0xFFFFFFFF)).to(tl.int64)
