"""The radix select's shared parts (plugins/stable_topk: kernel.py's radix form and
prefilter.py's block-max form): order-preserving 32-bit keys of fp32 scores, and the narrowing of
a digit pass's finished histogram into the prefix of the k-th best key."""

from __future__ import annotations

import triton
import triton.language as tl

# constants the kernels read (Triton only lets jit code see constexpr globals)
BIG = tl.constexpr(3.4028234663852886e38)  # float32 max: the reference clamps +-inf to it


@triton.jit
def order_key32(s):
    """Order-preserving 32-bit keys (uint32) of fp32 values: ascending key == ascending clamped
    value, and equal keys for equal values: -0.0 takes +0.0's key (the reference's sort holds
    them equal, so they keep index order; their bits alone would put -0.0 below). Every key is
    above 0, so 0 stands below every score."""
    s = tl.minimum(tl.maximum(s, -BIG), BIG)
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def order_key(s):
    """order_key32 as an int64 holding the 32 bits (the radix and block-max forms pack it with
    an index into 64-bit keys)."""
    return order_key32(s).to(tl.int64) & 0xFFFFFFFF


@triton.jit
def ordered_keys(scores_ptr, row, n, ok, N):
    """order_key of the scores at n of a row [N] (masked entries: the key of 0.0)."""
    return order_key(tl.load(scores_ptr + row * N + n, mask=ok, other=0.0))


@triton.jit
def chunk_keys(scores_ptr, N, CHUNK: tl.constexpr):
    """Grid (rows, chunks): this program's row, chunk, chunk count, entry indices, their mask and
    keys."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    n = p * CHUNK + tl.arange(0, CHUNK)
    ok = n < N
    return row, p, tl.num_programs(1), n, ok, ordered_keys(scores_ptr, row, n, ok, N)


@triton.jit
def narrowed(hist, state, row, PREV: tl.constexpr, PREV_BITS: tl.constexpr, HIST_BINS: tl.constexpr,
             PASSES: tl.constexpr):
    """(prefix, k_rem) after pass PREV: pass PREV's state (the prefix and count it started from)
    narrowed by the digit its finished histogram holds the k_rem-th best entry in. Every program
    of the next launch derives it itself: no program has to wait for the others to finish."""
    prefix, k_rem, _ = narrowed_count(hist, state, row, PREV, PREV_BITS, HIST_BINS, PASSES)
    return prefix, k_rem


@triton.jit
def narrowed_count(hist, state, row, PREV: tl.constexpr, PREV_BITS: tl.constexpr, HIST_BINS: tl.constexpr,
                   PASSES: tl.constexpr):
    """narrowed's (prefix, k_rem) and the count in the digit chosen (narrow_by_count)."""
    prefix = tl.load(state + (row * PASSES + PREV) * 2, cache_modifier=".cg")
    k_rem = tl.load(state + (row * PASSES + PREV) * 2 + 1, cache_modifier=".cg")
    b = tl.arange(0, 1 << PREV_BITS)
    tot = tl.load(hist + (row * PASSES + PREV) * HIST_BINS + b, cache_modifier=".cg")
    return narrow_by_count(tot, prefix, k_rem, 1 << PREV_BITS, PREV_BITS)


@triton.jit
def narrow_by(tot, prefix, k_rem, BINS: tl.constexpr, bits):
    """(prefix, k_rem) narrowed by a `bits`-wide digit pass's whole histogram `tot` [BINS] (entries
    in play per digit; BINS >= 2^bits, the bins past 2^bits empty): the digit d that holds the
    k_rem-th best entry joins the prefix, and the entries above d leave the count."""
    prefix, k_rem, _ = narrow_by_count(tot, prefix, k_rem, BINS, bits)
    return prefix, k_rem


@triton.jit
def narrow_by_count(tot, prefix, k_rem, BINS: tl.constexpr, bits):
    """narrow_by's (prefix, k_rem) and the count of entries in the digit d chosen (>= the new
    k_rem; equal where the k_rem-th best is the last of its digit)."""
    b = tl.arange(0, BINS)
    at_or_above = tl.sum(tot, axis=0) - tl.cumsum(tot, axis=0) + tot  # entries with digit >= b
    above = at_or_above - tot
    pick = (above < k_rem) & (at_or_above >= k_rem)
    d = tl.max(tl.where(pick, b, -1), axis=0)
    above_d = tl.sum(tl.where(b == d, above, 0), axis=0)
    in_d = tl.sum(tl.where(b == d, tot, 0), axis=0)
    return (prefix << bits) | d.to(tl.int64), k_rem - above_d.to(tl.int64), in_d.to(tl.int64)


@triton.jit
def place_among(mine, keys_ptr, count, CMP_BLOCK: tl.constexpr, TILE: tl.constexpr = False,
                AHEAD: tl.constexpr = False):
    """The place of each of `mine` (unique full keys: score key << 32 | reversed index) among the
    `count` keys at keys_ptr: how many of them are above it, counted CMP_BLOCK at a time. The
    loop's instructions are mostly its compares: the sm_90 build of the listed rank (8 keys
    against 128 a step, one warp) spends 183 a thread per step, 64 ISETP and 32 SEL of them for
    the 32 64-bit compares and 8 REDUX for the cross-lane sums; counts kept per compared slot and
    summed once after the loop took 185 (session 49). Each step waits for its keys from L2 and,
    by default, for their trip through shared memory into the compare's layout (a store, a
    barrier and a load). TILE loads them straight into that layout (the one-warp build: no
    shared memory in the loop). AHEAD loads the next step's keys before comparing this step's, so
    the wait can overlap a step of compares; in the one-warp sm_90 builds it does only with TILE
    at 64 keys a step (the loads first, then the compares), since at 128 and 256 ptxas moves the
    loads after the compares, and without TILE the keys' store to shared memory waits for them
    at once. The rank's RANK_TILE / RANK_AHEAD: both on, at 64 keys a step, by default from 16 to
    64 rows (StableTopkLauncher._rank_load; H100, a listed pool: 17.7 against 18.9 us at 32 rows)."""
    place = tl.zeros(mine.shape, dtype=tl.int32)
    if AHEAD:
        other = _step_keys(keys_ptr, 0, count, CMP_BLOCK, TILE)
        # one step per CMP_BLOCK keys, as below; the last step's load is all masked
        for c in tl.range(CMP_BLOCK, count + CMP_BLOCK, CMP_BLOCK):
            ahead = _step_keys(keys_ptr, c, count, CMP_BLOCK, TILE)
            place += _count_above(other, mine, TILE)
            other = ahead
    else:
        for c in tl.range(0, count, CMP_BLOCK):
            place += _count_above(_step_keys(keys_ptr, c, count, CMP_BLOCK, TILE), mine, TILE)
    return place


@triton.jit
def _step_keys(keys_ptr, start, count, CMP_BLOCK: tl.constexpr, TILE: tl.constexpr):
    """The CMP_BLOCK keys from `start` (0 past `count`: below every key): a vector, or with TILE
    one row [1, CMP_BLOCK] of the compare's tile."""
    j = start + tl.arange(0, CMP_BLOCK)
    if TILE:
        j = j[None, :]
    return tl.load(keys_ptr + j, mask=j < count, other=0, cache_modifier=".cg")


@triton.jit
def _count_above(other, mine, TILE: tl.constexpr):
    """How many of a step's keys `other` (_step_keys') are above each of `mine`."""
    if TILE:
        above = other > mine[:, None]
    else:
        above = other[None, :] > mine[:, None]
    return tl.sum(above.to(tl.int32), axis=1)


@triton.jit
def write_picks(scores_ptr, vals_ptr, idx_ptr, row, N, k, place, index, put, entries_ptr, W,
                LISTED: tl.constexpr):
    """Index and score of each pick at its place in the row's k outputs; the values come from the
    scores themselves (the keys hold the clamped ones), as the reference's. LISTED (scores of a
    listed pool, entries_ptr its ids [rows, N]): the pick's entry id instead, into a row of W,
    -1 where its score is -inf (padding picked), as model/csa2_ops.py:listed_picks maps them;
    no values."""
    if LISTED:
        score = tl.load(scores_ptr + row * N + index, mask=put, other=0.0)
        entry = tl.load(entries_ptr + row * N + index, mask=put, other=-1).to(tl.int64)
        tl.store(idx_ptr + row * W + place, tl.where(score == float("-inf"), -1, entry), mask=put)
    else:
        tl.store(idx_ptr + row * k + place, index, mask=put)
        tl.store(vals_ptr + row * k + place, tl.load(scores_ptr + row * N + index, mask=put, other=0.0),
                 mask=put)


@triton.jit
def pad_listed_row(idx_ptr, row, k, W, LISTED: tl.constexpr):
    """LISTED: the row's columns k .. W - 1 past the top-k's (a pool shorter than the k asked
    for) set to -1, as listed_picks pads them."""
    if LISTED:
        for c in tl.range(k, W, 256):
            col = c + tl.arange(0, 256)
            tl.store(idx_ptr + row * W + col, tl.full([256], -1, tl.int64), mask=col < W)


@triton.jit
def clear_histograms(hist, row, HIST_BINS: tl.constexpr, PASSES: tl.constexpr):
    """The row's digit-pass histograms back to 0 for the next call (CUDA-graph replay)."""
    b = tl.arange(0, HIST_BINS)
    for i in tl.static_range(PASSES):
        tl.store(hist + (row * PASSES + i) * HIST_BINS + b, tl.zeros_like(b))
