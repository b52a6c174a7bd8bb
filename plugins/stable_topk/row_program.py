"""Stable top-k with one program per row: the radix select of kernel.py (the same digit passes,
select and rank, the same bits) inside one launch, each row's program looping over its entries
chunk by chunk instead of spreading a pass over programs and launches.

For a decode batch over short rows: a Reindex layer's listed pool (16K scores a row) at 64 rows
is 64 x 16K entries, which the six-launch form ranks in 47.5 us on the H200, 2% of its bytes'
roofline (docs/benchmarks.md, session 20); with a program per row the launches are one and the
rows run side by side, each program's passes back to back. A long single row would run on one
SM: StableTopkLauncher(overrides={"ROW_PROGRAM": True}) opts in (benchmark sweeps) until the H200
says for which rows and lengths it is faster.
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsflash.plugins.launch import next_pow2, require
from dsflash.plugins.pdl import wait_for_earlier_grids
from dsflash.plugins.stable_topk.kernel import _ordered_keys, narrow_by_digit


@triton.jit
def _row_digit(scores_ptr, row, N, prefix, k_rem, SHIFT: tl.constexpr, BITS: tl.constexpr,
               CHUNK: tl.constexpr):
    """One digit pass over the row: the histogram of the digit at SHIFT among the entries whose
    higher bits equal `prefix`, and the digit holding the k_rem-th best of them; returns the
    longer prefix and the count still to find below it."""
    BINS: tl.constexpr = 1 << BITS
    b = tl.arange(0, BINS)
    hist = tl.zeros([BINS], dtype=tl.int32)
    for c in range(0, N, CHUNK):
        n = c + tl.arange(0, CHUNK)
        ok = n < N
        key = _ordered_keys(scores_ptr, row, n, ok, N)
        play = ok & ((key >> (SHIFT + BITS)) == prefix)
        hist += tl.histogram(((key >> SHIFT) & (BINS - 1)).to(tl.int32), BINS, mask=play)
    return narrow_by_digit(hist, b, prefix, k_rem, BITS)


@triton.jit
def radix_row_kernel(scores_ptr, N, k, sel, vals_ptr, idx_ptr, KP: tl.constexpr, BITS: tl.constexpr,
                     CHUNK: tl.constexpr, RANK_BLOCK: tl.constexpr, CMP_BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    """Grid (rows,). V, the key of the k-th best entry, BITS at a time; then the entries above V
    and the first (k - #above) equal to V in index order into sel[row, :k] as (key, reversed
    index), unsorted; then each one's place, the count of selected keys above it (unique keys:
    kernel.py's rank pass), and its index and value there."""
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    prefix = tl.zeros([], dtype=tl.int64)
    k_rem = prefix + k
    for i in tl.static_range(32 // BITS):
        prefix, k_rem = _row_digit(scores_ptr, row, N, prefix, k_rem, 32 - BITS * (i + 1), BITS, CHUNK)
    v, need_eq = prefix, k_rem
    n_gt = k - need_eq
    gt_seen = tl.zeros([], dtype=tl.int32)
    eq_seen = tl.zeros([], dtype=tl.int32)
    for c in range(0, N, CHUNK):
        n = c + tl.arange(0, CHUNK)
        ok = n < N
        key = _ordered_keys(scores_ptr, row, n, ok, N)
        gt = ok & (key > v)
        eq = ok & (key == v)
        gt_rank = gt_seen + tl.cumsum(gt.to(tl.int32), axis=0) - 1
        eq_rank = eq_seen + tl.cumsum(eq.to(tl.int32), axis=0) - 1
        full = ((key << 32) | (0xFFFFFFFF - n.to(tl.int64))).to(tl.uint64)  # best, then lowest index
        tl.store(sel + row * KP + gt_rank, full, mask=gt)
        tl.store(sel + row * KP + n_gt + eq_rank, full, mask=eq & (eq_rank < need_eq))
        gt_seen += tl.sum(gt.to(tl.int32), axis=0)
        eq_seen += tl.sum(eq.to(tl.int32), axis=0)
    tl.debug_barrier()  # the block's stores to sel are visible to all of its threads after this
    for r0 in range(0, k, RANK_BLOCK):
        r = r0 + tl.arange(0, RANK_BLOCK)
        keep = r < k
        mine = tl.load(sel + row * KP + r, mask=keep, other=0, cache_modifier=".cg")
        rank = tl.zeros([RANK_BLOCK], dtype=tl.int32)
        for c in range(0, k, CMP_BLOCK):
            j = c + tl.arange(0, CMP_BLOCK)
            other = tl.load(sel + row * KP + j, mask=j < k, other=0, cache_modifier=".cg")
            rank += tl.sum((other[None, :] > mine[:, None]).to(tl.int32), axis=1)
        index = (0xFFFFFFFF - (mine & 0xFFFFFFFF)).to(tl.int64)
        tl.store(idx_ptr + row * k + rank, index, mask=keep)
        tl.store(vals_ptr + row * k + rank, tl.load(scores_ptr + row * N + index, mask=keep, other=0.0),
                 mask=keep)


def row_program_launch(flat, n: int, k_out: int, sel, vals, idx, overrides: dict, pdl: dict) -> None:
    """Launch radix_row_kernel over `flat` [rows, n] (k_out <= n) into vals / idx [rows, k_out];
    `sel` [rows, >= k_out] uint64 is scratch. overrides: CHUNK (entries per step of a pass,
    default 2048), ROW_BITS (digit width, 8 or 4: the passes must tile 32 bits), RANK_BLOCK,
    CMP_BLOCK, num_warps."""
    bits = overrides.get("ROW_BITS", 8)
    require(bits in (4, 8), f"StableTopk: ROW_BITS {bits} is not 4 or 8 (the passes tile 32 bits)")
    chunk = overrides.get("CHUNK") or 2048
    require(chunk >= 16 and chunk == next_pow2(chunk), f"StableTopk: CHUNK {chunk} is not a power of "
            "two >= 16 (one program's step over its row)")
    kp = sel.shape[1]
    radix_row_kernel[(flat.shape[0],)](
        flat, n, k_out, sel, vals, idx, KP=kp, BITS=bits, CHUNK=chunk,
        RANK_BLOCK=min(overrides.get("RANK_BLOCK", 32), kp),
        CMP_BLOCK=min(overrides.get("CMP_BLOCK", 256), next_pow2(kp)),
        num_warps=overrides.get("num_warps", 4), **pdl)
