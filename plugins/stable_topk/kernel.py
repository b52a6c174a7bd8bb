"""Stable top-k as a radix select over all SMs (decode sizes: a few rows of up to ~1M scores,
k up to 8192), in one launch per digit pass plus a select launch, each reading the scores once.

Each score maps to an order-preserving 32-bit key (after clamping +-inf to the largest finite
values, as the reference sorts). The digit passes find V, the key of the k-th best entry, a few
bits at a time (DIGITS: 8 + 8 + 8 + 8 by default): every program histograms the digit of its
entries still in play (the higher bits equal the prefix found so far) with tl.histogram and adds
it into the row's histogram with atomics; the last program of the row (a counter) picks the
digit that holds the k-th entry, narrows the prefix and clears the histogram. The select pass
then writes every entry above V and the first (k - #above) entries equal to V in index order
(the last pass's per-program counts give each program how many equal entries come before its
chunk); its last program sorts the k selected by (key, then lower index) and writes indices
and values. That is the reference's stable order exactly.

Measured and dropped (H200, 2026-12-03): an early finish that, once at most a few hundred
entries were left in play after a digit pass, had the next pass append them to a buffer and its
last program sort them with tl.sort (the later launches exiting on a flag). It was exact, and
slower: 27.2 us at 128K with a 1,024-entry sort, 47.2 with 2,048, 90.4 with 4,096, against 23.1 us
for every pass; one program's bitonic sort costs more than the launches it saves. Programmatic
dependent launch (plugins/pdl.py) is kept: 22.0 us against 23.8 us without it.

NaN scores are not checked (that would sync the host every call) and do not order as the
reference's sort orders them; index scores are finite or -inf.

Why 8-bit digits on 512-entry chunks: tl.histogram builds each warp's histogram from one ballot
per digit bit, and then every thread popcounts the bins it owns, so its cost per entry grows
with bins / 32 x bits. The first radix version (11/11/10-bit digits, 4K-entry chunks, 8 warps:
~64 owned bins x 12 steps per entry) ran 70 us at 128K entries on the H200, slower than the
stable sort (59 us); 256 bins cost ~1/10 of that per entry, for one more launch: 23.7-25.3 us,
bit-exact (H200, 2026-12-02). The version before it (bitonic tl.topk per 8K-entry chunk, merged
by one program) took 182 us (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.launch import LauncherBase, check_device, check_dtype, next_pow2, require
from dsflash.plugins.pdl import pdl_launch_args, wait_for_earlier_grids
from dsflash.plugins.stable_topk.reference import stable_topk as stable_topk_reference

# constants the kernels read (Triton only lets jit code see constexpr globals)
BIG = tl.constexpr(3.4028234663852886e38)  # float32 max: the reference clamps +-inf to it
# digit widths of the passes over the 32-bit key, most significant first (the launch default;
# `DIGITS` in the overrides for a sweep). Up to 11 bits: the last program's histogram arithmetic
# stays in registers (ptxas, sm_90: 12 bits spill).
DIGITS = (8, 8, 8, 8)


def digit_passes(digits: tuple) -> tuple:
    """(shift, bits) per pass, most significant first; the widths must add up to 32."""
    require(sum(digits) == 32 and all(1 <= d <= 11 for d in digits),
            f"StableTopk: digit widths {digits} must be 1..11 bits each and add up to 32")
    shifts = [32 - sum(digits[:i + 1]) for i in range(len(digits))]
    return tuple(zip(shifts, digits))


@triton.jit
def _ordered_keys(scores_ptr, row, n, ok, N):
    """Order-preserving keys (int64 holding 32 bits): ascending key == ascending clamped score."""
    s = tl.load(scores_ptr + row * N + n, mask=ok, other=0.0)
    s = tl.minimum(tl.maximum(s, -BIG), BIG)
    bits = s.to(tl.uint32, bitcast=True)
    ordered = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return ordered.to(tl.int64) & 0xFFFFFFFF


@triton.jit
def _chunk_keys(scores_ptr, N, CHUNK: tl.constexpr):
    """Grid (rows, chunks): this program's row, chunk, chunk count, entry indices, their mask and
    keys."""
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    n = p * CHUNK + tl.arange(0, CHUNK)
    ok = n < N
    return row, p, tl.num_programs(1), n, ok, _ordered_keys(scores_ptr, row, n, ok, N)


@triton.jit
def radix_digit_pass_kernel(scores_ptr, N, k, hist, state, counter, prog_hist,
                            SHIFT: tl.constexpr, BITS: tl.constexpr, PASS: tl.constexpr,
                            FIRST: tl.constexpr, LAST: tl.constexpr, CHUNK: tl.constexpr,
                            HIST_BINS: tl.constexpr, SLOTS: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (rows, chunks). state[row] = (prefix of V's key above SHIFT + BITS, entries of the
    k best still to find among those in play). hist rows hold HIST_BINS (the widest digit's
    bins); counter rows SLOTS (one per pass, then the select pass's two)."""
    wait_for_earlier_grids(PDL)
    row, p, n_prog, n, ok, key = _chunk_keys(scores_ptr, N, CHUNK)
    if FIRST:
        prefix = tl.zeros([], dtype=tl.int64)
        k_rem = prefix + k  # (k may arrive as a constant: Triton specialises 1)
    else:
        prefix = tl.load(state + row * 2)
        k_rem = tl.load(state + row * 2 + 1)
    BINS: tl.constexpr = 1 << BITS
    play = ok & ((key >> (SHIFT + BITS)) == prefix)
    digit = ((key >> SHIFT) & (BINS - 1)).to(tl.int32)
    h = tl.histogram(digit, BINS, mask=play)
    b = tl.arange(0, BINS)
    if LAST:  # per-program counts of the last digit, for the select pass's tie order
        tl.store(prog_hist + (row * n_prog + p) * BINS + b, h)
    tl.atomic_add(hist + row * HIST_BINS + b, h, mask=h > 0)
    tl.debug_barrier()  # every thread's adds are issued before the counter moves
    done = tl.atomic_add(counter + row * SLOTS + PASS, 1)  # acq_rel at GPU scope
    if done == n_prog - 1:  # the last program of the row picks the digit
        tot = tl.load(hist + row * HIST_BINS + b, cache_modifier=".cg")
        tl.store(hist + row * HIST_BINS + b, tl.zeros_like(tot))  # cleared for the next pass
        tl.store(counter + row * SLOTS + PASS, 0)
        at_or_above = tl.sum(tot, axis=0) - tl.cumsum(tot, axis=0) + tot  # entries with digit >= b
        above = at_or_above - tot
        pick = (above < k_rem) & (at_or_above >= k_rem)
        d = tl.max(tl.where(pick, b, -1), axis=0)
        above_d = tl.sum(tl.where(b == d, above, 0), axis=0)
        tl.store(state + row * 2, (prefix << BITS) | d.to(tl.int64))
        tl.store(state + row * 2 + 1, k_rem - above_d.to(tl.int64))


@triton.jit
def radix_select_kernel(scores_ptr, N, k, state, counter, prog_hist, sel, vals_ptr, idx_ptr,
                        CHUNK: tl.constexpr, KP: tl.constexpr, PP: tl.constexpr, LAST_BITS: tl.constexpr,
                        SLOTS: tl.constexpr, ALLOC: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (rows, chunks): entries above V, then the first equal ones in index order, into sel;
    the last program sorts the k keys (score key, then the reversed index) and emits them."""
    wait_for_earlier_grids(PDL)
    row, p, n_prog, n, ok, key = _chunk_keys(scores_ptr, N, CHUNK)
    v = tl.load(state + row * 2)
    need_eq = tl.load(state + row * 2 + 1)
    n_gt = k - need_eq
    gt = ok & (key > v)
    eq = ok & (key == v)
    pp = tl.arange(0, PP)
    LAST_BINS: tl.constexpr = 1 << LAST_BITS
    before = tl.load(prog_hist + (row * n_prog + pp) * LAST_BINS + (v & (LAST_BINS - 1)), mask=pp < p,
                     other=0)
    eq_rank = tl.sum(before, axis=0) + tl.cumsum(eq.to(tl.int32), axis=0) - 1
    take_eq = eq & (eq_rank < need_eq)
    base = tl.atomic_add(counter + row * SLOTS + ALLOC, tl.sum(gt.to(tl.int32), axis=0))  # a run of slots
    gt_rank = base + tl.cumsum(gt.to(tl.int32), axis=0) - 1
    full = ((key << 32) | (0xFFFFFFFF - n.to(tl.int64))).to(tl.uint64)  # unique: best, then lowest index
    tl.store(sel + row * KP + gt_rank, full, mask=gt)
    tl.store(sel + row * KP + n_gt + eq_rank, full, mask=take_eq)
    tl.debug_barrier()  # every thread's keys are written before the counter moves
    done = tl.atomic_add(counter + row * SLOTS + ALLOC + 1, 1)  # acq_rel at GPU scope
    if done == n_prog - 1:
        kk = tl.arange(0, KP)
        cand = tl.load(sel + row * KP + kk, mask=kk < k, other=0, cache_modifier=".cg")
        top = tl.sort(cand, descending=True)  # padding (0) sorts below every real key
        tl.store(counter + row * SLOTS + ALLOC, 0)  # cleared for the next launch
        tl.store(counter + row * SLOTS + ALLOC + 1, 0)
        index = (0xFFFFFFFF - (top & 0xFFFFFFFF)).to(tl.int64)
        keep = kk < k
        tl.store(idx_ptr + row * k + kk, index, mask=keep)
        # values from the scores themselves (the keys hold the clamped ones), as the reference
        tl.store(vals_ptr + row * k + kk, tl.load(scores_ptr + row * N + index, mask=keep, other=0.0),
                 mask=keep)


class StableTopkLauncher(LauncherBase):
    """Holds the histograms, counters and selection buffers (self-clearing, so the launches
    capture into a CUDA graph); one instance per device/stream, calls on it must not overlap.
    Overrides (sweeps): DIGITS, CHUNK, num_warps, MAX_K, PDL (False: plain launches)."""

    MAX_PROGRAMS = 1024  # per row: the select pass reads every program's tie count in one load

    def _workspace(self, device, rows: int, n_prog: int, kp: int, passes: tuple) -> dict:
        key = (device, passes)
        ws = self._ws.get(key)
        if ws is None or ws["state"].shape[0] < rows or ws["prog_hist"].shape[1] < n_prog \
                or ws["sel"].shape[1] < kp:
            rows, n_prog, kp = (max(rows, 1), max(n_prog, 1), max(kp, 1))
            bins = 1 << max(bits for _, bits in passes)
            ws = {"hist": torch.zeros(rows, bins, dtype=torch.int32, device=device),
                  "counter": torch.zeros(rows, len(passes) + 2, dtype=torch.int32, device=device),
                  "state": torch.empty(rows, 2, dtype=torch.int64, device=device),
                  "prog_hist": torch.empty(rows, n_prog, 1 << passes[-1][1], dtype=torch.int32,
                                           device=device),
                  "sel": torch.empty(rows, kp, dtype=torch.uint64, device=device)}
            self._ws[key] = ws
        return ws

    def __call__(self, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        op = "StableTopk"
        check_dtype(op, "scores", scores, (torch.float32,))
        require(scores.dim() >= 1 and k >= 1, f"{op}: needs scores [..., N] and k >= 1, got "
                f"{tuple(scores.shape)} and k={k}")
        check_device(op, scores=scores)
        n = scores.shape[-1]
        k_out = min(k, n)
        lead = scores.shape[:-1]
        rows = scores.numel() // max(n, 1)
        if n == 0 or rows == 0:
            return (scores.new_empty(*lead, 0),
                    torch.empty(*lead, 0, dtype=torch.int64, device=scores.device))
        kp = next_pow2(k_out)
        if kp > self._overrides.get("MAX_K", 8192) or n >= 2**31:
            return stable_topk_reference(scores, k)  # more than one program sorts, or 32-bit indices
        passes = digit_passes(tuple(self._overrides.get("DIGITS", DIGITS)))
        # 512-entry chunks (H200 sweep at 128K: 23.7 us; 1K 25.4, 2K 28.8); they grow past that for
        # very long rows, so a row has at most MAX_PROGRAMS
        chunk = max(self._overrides.get("CHUNK", 512), next_pow2(triton.cdiv(n, self.MAX_PROGRAMS)))
        n_prog = triton.cdiv(n, chunk)
        flat = scores.contiguous().view(rows, n)
        vals = torch.empty(rows, k_out, dtype=torch.float32, device=scores.device)
        idx = torch.empty(rows, k_out, dtype=torch.int64, device=scores.device)
        ws = self._workspace(scores.device, rows, n_prog, kp, passes)
        warps = self._overrides.get("num_warps", 4)
        bins, slots = ws["hist"].shape[1], ws["counter"].shape[1]
        pdl = pdl_launch_args(scores.device, self._overrides)
        for i, (shift, bits) in enumerate(passes):
            radix_digit_pass_kernel[(rows, n_prog)](
                flat, n, k_out, ws["hist"], ws["state"], ws["counter"], ws["prog_hist"], SHIFT=shift,
                BITS=bits, PASS=i, FIRST=i == 0, LAST=i == len(passes) - 1, CHUNK=chunk, HIST_BINS=bins,
                SLOTS=slots, num_warps=warps, **pdl)
        radix_select_kernel[(rows, n_prog)](
            flat, n, k_out, ws["state"], ws["counter"], ws["prog_hist"], ws["sel"], vals, idx, CHUNK=chunk,
            KP=kp, PP=next_pow2(n_prog), LAST_BITS=passes[-1][1], SLOTS=slots, ALLOC=len(passes),
            num_warps=warps, **pdl)
        return vals.view(*lead, k_out), idx.view(*lead, k_out)


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's signature; a fresh launcher per call (hold a StableTopkLauncher to reuse
    its workspace)."""
    return StableTopkLauncher()(scores, k)
