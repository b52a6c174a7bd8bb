"""Stable top-k as a radix select over all SMs (decode sizes: a few rows of up to ~1M scores,
k up to 8192), in one launch: a digit pass per digit and a select pass, each reading the scores
once, ordered inside the launch by start tickets (plugins/ticket_sync.py).

Each score maps to an order-preserving 32-bit key (after clamping +-inf to the largest finite
values, as the reference sorts). The digit passes find V, the key of the k-th best entry, a few
bits at a time (DIGITS: 8 + 8 + 8 + 8 by default): every program histograms the digit of its
entries still in play (the higher bits equal the prefix found so far) with tl.histogram and adds
it into the row's histogram with atomics; the last program of the pass (a counter) picks the
digit that holds the k-th entry, narrows the prefix, clears the histogram and releases the next
pass. The select pass then writes every entry above V and the first (k - #above) entries equal
to V in index order (the last digit pass's per-program counts give each program how many equal
entries come before its chunk); its last program sorts the k selected by (key, then lower index)
and writes indices and values. That is the reference's stable order exactly.

A row's programs take tickets: ticket // programs-per-pass is the pass, the rest the chunk, so a
program waits only for the pass before its own, whose programs all took lower tickets and are
running. Each program loads its chunk's keys before it waits (the scores are ready at launch).
Session 4's form was one launch per pass (5 dependent launches, 23.7-25.3 us at 128K entries on
the H200, docs/benchmarks.md).

NaN scores are not checked (that would sync the host every call) and do not order as the
reference's sort orders them; index scores are finite or -inf.

Why 8-bit digits on 512-entry chunks: tl.histogram builds each warp's histogram from one ballot
per digit bit, and then every thread popcounts the bins it owns, so its cost per entry grows
with bins / 32 x bits. The first radix version (11/11/10-bit digits, 4K-entry chunks, 8 warps:
~64 owned bins x 12 steps per entry) ran 70 us at 128K entries on the H200, slower than the
stable sort (59 us); 256 bins cost ~1/10 of that per entry. Every pass histograms into as many
bins as the widest digit needs, so schedules with one wide digit pay for it in every pass. The
version before the radix select (bitonic tl.topk per 8K-entry chunk, merged by one program)
took 182 us.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.launch import LauncherBase, check_device, check_dtype, interpreting, next_pow2, require
from dsflash.plugins.stable_topk.reference import stable_topk as stable_topk_reference
from dsflash.plugins.ticket_sync import wait_at_least

# constants the kernels read (Triton only lets jit code see constexpr globals)
BIG = tl.constexpr(3.4028234663852886e38)  # float32 max: the reference clamps +-inf to it
# per-row control words: tickets, passes released, programs gone, the select pass's slot
# allocator and its done count, then one done count per digit pass
TICKET, READY, GONE, ALLOC, PICKED, PASS0 = (tl.constexpr(i) for i in range(6))
# digit widths of the passes over the 32-bit key, most significant first (the launch default;
# `DIGITS` in the overrides for a sweep). Up to 11 bits: the last program's histogram arithmetic
# stays in registers (ptxas, sm_90: 12 bits spill).
DIGITS = (8, 8, 8, 8)
# all passes in one launch (ticket-ordered) unless the overrides say ONE_LAUNCH=False (one launch
# per pass, session 4's form)
ONE_LAUNCH_DEFAULT = True


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
def _digit_pass(key, ok, row, p, n_prog, stage, n_pass, k, sched_ptr, hist, state, ctl, prog_hist,
                BINS: tl.constexpr):
    """Digit pass `stage` over this program's chunk; its last program picks the digit of V and
    releases the next pass. state[row] = (prefix of V's key above the digit, entries of the k
    best still to find among those in play)."""
    shift = tl.load(sched_ptr + stage * 2)
    bits = tl.load(sched_ptr + stage * 2 + 1)
    later = stage > 0  # the first pass starts from the empty prefix and k
    prefix = tl.load(state + row * 2, mask=later, other=0, cache_modifier=".cg")
    k_rem = tl.load(state + row * 2 + 1, mask=later, other=0, cache_modifier=".cg")
    k_rem = tl.where(later, k_rem, k)
    play = ok & ((key >> (shift + bits)) == prefix)
    digit = ((key >> shift) & ((1 << bits) - 1)).to(tl.int32)
    h = tl.histogram(digit, BINS, mask=play)
    b = tl.arange(0, BINS)
    if stage == n_pass - 1:  # per-program counts of the last digit, for the select pass's tie order
        tl.store(prog_hist + (row * n_prog + p) * BINS + b, h)
    tl.atomic_add(hist + row * BINS + b, h, mask=h > 0)
    tl.debug_barrier()  # every thread's adds are issued before the count moves
    if tl.atomic_add(ctl + PASS0 + stage, 1) == n_prog - 1:  # acq_rel: the last program of the pass
        tot = tl.load(hist + row * BINS + b, cache_modifier=".cg")
        tl.store(hist + row * BINS + b, tl.zeros_like(tot))  # cleared for the next pass
        tl.store(ctl + PASS0 + stage, 0)
        at_or_above = tl.sum(tot, axis=0) - tl.cumsum(tot, axis=0) + tot  # entries with digit >= b
        above = at_or_above - tot
        pick = (above < k_rem) & (at_or_above >= k_rem)
        d = tl.max(tl.where(pick, b, -1), axis=0)
        above_d = tl.sum(tl.where(b == d, above, 0), axis=0)
        tl.store(state + row * 2, (prefix << bits) | d.to(tl.int64))
        tl.store(state + row * 2 + 1, k_rem - above_d.to(tl.int64))
        tl.debug_barrier()  # the state is written before the next pass is released
        tl.atomic_add(ctl + READY, 1, sem="release")


@triton.jit
def _select_pass(key, ok, n, row, p, n_prog, n_pass, k, N, sched_ptr, scores_ptr, state, ctl, prog_hist,
                 sel, vals_ptr, idx_ptr, BINS: tl.constexpr, KP: tl.constexpr, PP: tl.constexpr):
    """Entries above V, then the first equal ones in index order, into sel; the last program sorts
    the k keys (score key, then the reversed index) and emits them."""
    v = tl.load(state + row * 2, cache_modifier=".cg")
    need_eq = tl.load(state + row * 2 + 1, cache_modifier=".cg")
    last_bits = tl.load(sched_ptr + (n_pass - 1) * 2 + 1)
    n_gt = k - need_eq
    gt = ok & (key > v)
    eq = ok & (key == v)
    pp = tl.arange(0, PP)
    before = tl.load(prog_hist + (row * n_prog + pp) * BINS + (v & ((1 << last_bits) - 1)), mask=pp < p,
                     other=0, cache_modifier=".cg")
    eq_rank = tl.sum(before, axis=0) + tl.cumsum(eq.to(tl.int32), axis=0) - 1
    take_eq = eq & (eq_rank < need_eq)
    base = tl.atomic_add(ctl + ALLOC, tl.sum(gt.to(tl.int32), axis=0))  # a run of slots
    gt_rank = base + tl.cumsum(gt.to(tl.int32), axis=0) - 1
    full = ((key << 32) | (0xFFFFFFFF - n.to(tl.int64))).to(tl.uint64)  # unique: best, then lowest index
    tl.store(sel + row * KP + gt_rank, full, mask=gt)
    tl.store(sel + row * KP + n_gt + eq_rank, full, mask=take_eq)
    tl.debug_barrier()  # every thread's keys are written before the count moves
    if tl.atomic_add(ctl + PICKED, 1) == n_prog - 1:  # acq_rel: the last program of the pass
        kk = tl.arange(0, KP)
        cand = tl.load(sel + row * KP + kk, mask=kk < k, other=0, cache_modifier=".cg")
        top = tl.sort(cand, descending=True)  # padding (0) sorts below every real key
        tl.store(ctl + ALLOC, 0)  # cleared for the next launch
        tl.store(ctl + PICKED, 0)
        index = (0xFFFFFFFF - (top & 0xFFFFFFFF)).to(tl.int64)
        keep = kk < k
        tl.store(idx_ptr + row * k + kk, index, mask=keep)
        # values from the scores themselves (the keys hold the clamped ones), as the reference
        tl.store(vals_ptr + row * k + kk, tl.load(scores_ptr + row * N + index, mask=keep, other=0.0),
                 mask=keep)


@triton.jit
def radix_topk_kernel(scores_ptr, N, k, sched_ptr, n_pass, n_prog, this_pass, hist, state, ctl, prog_hist,
                      sel, vals_ptr, idx_ptr, CHUNK: tl.constexpr, BINS: tl.constexpr, KP: tl.constexpr,
                      PP: tl.constexpr, SLOTS: tl.constexpr, ONE_LAUNCH: tl.constexpr, POLL_NS: tl.constexpr):
    """Grid (rows, (n_pass + 1) * n_prog) with ONE_LAUNCH (passes by ticket, each waiting for the
    one before); else one launch per pass, grid (rows, n_prog), this_pass saying which (the
    launch boundaries order them). sched: (shift, bits) per digit pass; hist rows hold BINS (the
    widest digit's bins); ctl rows SLOTS (zero between calls)."""
    row = tl.program_id(0).to(tl.int64)
    c = ctl + row * SLOTS
    if ONE_LAUNCH:
        ticket = tl.atomic_add(c + TICKET, 1)  # start order within the row (acq_rel)
    else:
        ticket = this_pass * n_prog + tl.program_id(1)
    stage = ticket // n_prog
    p = ticket % n_prog
    n = p * CHUNK + tl.arange(0, CHUNK)
    ok = n < N
    key = _ordered_keys(scores_ptr, row, n, ok, N)  # the scores are ready: load before waiting
    if ONE_LAUNCH and stage > 0:
        wait_at_least(c + READY, stage, POLL_NS)  # the pass before this one took lower tickets
    if stage < n_pass:
        _digit_pass(key, ok, row, p, n_prog, stage, n_pass, k, sched_ptr, hist, state, c, prog_hist, BINS)
    else:
        _select_pass(key, ok, n, row, p, n_prog, n_pass, k, N, sched_ptr, scores_ptr, state, c, prog_hist,
                     sel, vals_ptr, idx_ptr, BINS, KP, PP)
    tl.debug_barrier()
    if tl.atomic_add(c + GONE, 1) == (n_pass + 1) * n_prog - 1:  # the row's last program to leave
        tl.store(c + TICKET, 0)
        tl.store(c + READY, 0)
        tl.store(c + GONE, 0)


class StableTopkLauncher(LauncherBase):
    """Holds the histograms, counters, digit schedule and selection buffers (self-clearing, so the
    launch captures into a CUDA graph); one instance per device/stream, calls on it must not
    overlap. Overrides (sweeps): DIGITS, CHUNK, num_warps, MAX_K, ONE_LAUNCH, POLL_NS (sleep
    between polls)."""

    MAX_PROGRAMS = 1024  # per row and pass: the select pass reads every program's tie count in one load

    def _workspace(self, device, rows: int, n_prog: int, kp: int, passes: tuple) -> dict:
        key = (device, passes)
        ws = self._ws.get(key)
        if ws is None or ws["state"].shape[0] < rows or ws["prog_hist"].shape[1] < n_prog \
                or ws["sel"].shape[1] < kp:
            rows, n_prog, kp = (max(rows, 1), max(n_prog, 1), max(kp, 1))
            bins = 1 << max(bits for _, bits in passes)
            ws = {"hist": torch.zeros(rows, bins, dtype=torch.int32, device=device),
                  "ctl": torch.zeros(rows, int(PASS0) + len(passes), dtype=torch.int32, device=device),
                  "sched": torch.tensor(passes, dtype=torch.int32, device=device),
                  "state": torch.empty(rows, 2, dtype=torch.int64, device=device),
                  "prog_hist": torch.empty(rows, n_prog, bins, dtype=torch.int32, device=device),
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
        # very long rows, so a pass has at most MAX_PROGRAMS per row
        chunk = max(self._overrides.get("CHUNK", 512), next_pow2(triton.cdiv(n, self.MAX_PROGRAMS)))
        n_prog = triton.cdiv(n, chunk)
        flat = scores.contiguous().view(rows, n)
        vals = torch.empty(rows, k_out, dtype=torch.float32, device=scores.device)
        idx = torch.empty(rows, k_out, dtype=torch.int64, device=scores.device)
        ws = self._workspace(scores.device, rows, n_prog, kp, passes)
        one = self._overrides.get("ONE_LAUNCH", ONE_LAUNCH_DEFAULT)
        launches = [(0, (len(passes) + 1) * n_prog)] if one else [(i, n_prog) for i in range(len(passes) + 1)]
        for this_pass, programs in launches:
            radix_topk_kernel[(rows, programs)](
                flat, n, k_out, ws["sched"], len(passes), n_prog, this_pass, ws["hist"], ws["state"],
                ws["ctl"], ws["prog_hist"], ws["sel"], vals, idx, CHUNK=chunk, BINS=ws["hist"].shape[1], KP=kp,
                PP=next_pow2(n_prog), SLOTS=ws["ctl"].shape[1], ONE_LAUNCH=one,
                POLL_NS=0 if interpreting() else self._overrides.get("POLL_NS", 0),
                num_warps=self._overrides.get("num_warps", 4))
        return vals.view(*lead, k_out), idx.view(*lead, k_out)


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's signature; a fresh launcher per call (hold a StableTopkLauncher to reuse
    its workspace)."""
    return StableTopkLauncher()(scores, k)
