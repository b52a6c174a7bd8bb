"""Stable top-k as a radix select over all SMs (decode sizes: a few rows of up to ~1M scores,
k up to 8192): one launch per digit pass, a select launch and a rank launch, none of whose
programs waits for another.

Each score maps to an order-preserving 32-bit key (after clamping +-inf to the largest finite
values, as the reference sorts). The digit passes find V, the key of the k-th best entry, a few
bits at a time (DIGITS: 8 + 8 + 8 + 8 by default): every program histograms the digit of its
entries still in play (the higher bits equal the prefix found so far) with tl.histogram and adds
it into the pass's own row histogram with relaxed atomics. The launch after reads that finished
histogram in every program and picks the digit that holds the k-th entry itself (a cumsum over
256 bins, while its scores load), so no program ends a pass by waiting on a counter for the
others. The select pass then writes every entry above V and the first (k - #above) entries
equal to V in index order (the last pass's per-program counts give each program how many equal
entries come before its chunk), unsorted; the rank pass puts each at its place, the count of
selected keys (key, then lower index: unique) above it, and writes indices and values. That is
the reference's stable order exactly. The rank pass also clears the histograms and the slot
counter for the next call (CUDA-graph replay).

Before (session 8, H200 ncu at 128K): each digit pass ended with acq_rel atomics and a counter
whose last program picked the digit (5.4-6.8 us per pass under ncu), and the select pass's last
program sorted the k keys with tl.sort (9.2 us, SM active 7.1K of 18.2K cycles: the rest was
that one program's sort). Now (H200, 2026-12-03, graph replay, k = 512): 14.3 us at 128K and
10.1 us at 4K against 22.1 and 19.0 us before, same run; ncu: 3.8-4.7 us per digit pass, 5.4 us
select. Measured and dropped in the same sweep: spreading each pass's atomics over 2-16 copies
of the histogram (the next launch sums them) against contention on the hot bins: 16.8-18.8 us
against 15.0 us with one (atomics on a hot bin were not what the passes waited on).

Measured and dropped (H200, 2026-12-03): an early finish that, once at most a few hundred
entries were left in play after a digit pass, had the next pass append them to a buffer and its
last program sort them with tl.sort (the later launches exiting on a flag). It was exact, and
slower: 27.2 us at 128K with a 1,024-entry sort, 47.2 with 2,048, 90.4 with 4,096, against 23.1 us
for every pass; one program's bitonic sort costs more than the launches it saves. Programmatic
dependent launch (plugins/pdl.py) is kept: 22.0 us against 23.8 us without it.

Rows of at least 4k blocks of PREFILTER_BLOCK entries take the block-max form instead
(prefilter.py: the same digit passes over the blocks' maxima, then only the entries above the k-th
maximum are ranked; H200 at 128K, k = 512: 58.2 against 173.3 us for 64 rows (98.6 before the
live collect, session 27), 13.2 against 17.1 us for one; StableTopkLauncher._form). Both forms give
the reference's bits.

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

from dsflash.model.csa2_ops import listed_picks as reference_listed_picks
from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.coresident import resident_programs
from dsflash.plugins.launch import (
    LauncherBase,
    check_device,
    check_dtype,
    check_shape,
    interpreting,
    is_pow2,
    next_pow2,
    require,
)
from dsflash.plugins.pdl import pdl_launch_args, wait_for_earlier_grids
from dsflash.plugins.stable_topk.keys import (
    chunk_keys,
    clear_histograms,
    narrowed,
    pad_listed_row,
    place_among,
    write_picks,
)
from dsflash.plugins.stable_topk.live_steps import LIVE_BLOCKS_DEFAULT, LIVE_STEP_CHOICES, live_blocks_for
from dsflash.plugins.stable_topk.prefilter import (
    block_max_pass_kernel,
    maxima_passes_kernel,
    prefilter_collect_kernel,
    prefilter_collect_live_kernel,
    prefilter_rank_kernel,
)
from dsflash.plugins.stable_topk.reference import stable_topk as stable_topk_reference

# digit widths of the passes over the 32-bit key, most significant first (the launch default;
# `DIGITS` in the overrides for a sweep). Up to 11 bits: the last program's histogram arithmetic
# stays in registers (ptxas, sm_90: 12 bits spill).
DIGITS = (8, 8, 8, 8)
# entries per block of the block-max form (prefilter.py; H200 sweep in _form)
PREFILTER_BLOCK = 16
# block maxima a row up to which the block-max form runs its digit passes after the first in one
# program per row (StableTopkLauncher._pass_launch; a listed pool of 16K has 2,048 blocks of 8)
FUSED_PASS_BLOCKS = 2048
# rows from which the block-max form's rank programs are one warp each (_block_max_form)
RANK_ONE_WARP_ROWS = 16
# rows up to which those one-warp programs compare 64 keys a step, loaded into the compare's tile
# a step ahead (_rank_shape, _rank_load); above, 128 keys a step loaded as a vector
RANK_TILE_MAX_ROWS = 64
# rows from which the fused passes over the maxima run in 4 warps instead of 8 (_pass_warps)
PASS_FOUR_WARP_ROWS = 8
# the rank programs' tie path over chunks of at least TIE_STEP_CHUNK entries: TIE_STEP at a time
# (_tie_step)
TIE_STEP, TIE_STEP_CHUNK = 512, 2048
# rows short of 4k blocks of PREFILTER_BLOCK take the block-max form over blocks of half as many
# from this many rows, where those are 4k (H200 and H100 sweeps in _form)
SMALL_BLOCK_ROWS = 16
# whether maxima_block offers the listed index kernel's block maxima (INDEX_MAXIMA): off. H100,
# session 53 (bench_layer_batch.py --topk-over INDEX_MAXIMA=True against False, same machine), a
# listed pool's Reindex layer, us with / without: bf16 keys 67.9 / 64.2 at 16 rows, 96.0-96.4 /
# 96.3-96.4 at 32, 153.5 / 152.5 at 64, 273.5 / 274.9 at 128; FP4 keys 54.6 / 50.6, 75.9-77.5 /
# 70.0-70.5, 109.5 / 104.4, 179.4 / 178.8 (its launch spills 8 B under the 128-register cap). The
# 32-row replay's passes end 1.09 us sooner, the collect after them 0.41 us later: the fused
# program's first digit pass over 2,048 maxima in few bins (docs/benchmarks.md, session 53)
INDEX_MAXIMA_DEFAULT = False


def digit_passes(digits: tuple) -> tuple:
    """(shift, bits) per pass, most significant first; the widths must add up to 32."""
    require(sum(digits) == 32 and all(1 <= d <= 11 for d in digits),
            f"StableTopk: digit widths {digits} must be 1..11 bits each and add up to 32")
    shifts = [32 - sum(digits[:i + 1]) for i in range(len(digits))]
    return tuple(zip(shifts, digits))


@triton.jit
def radix_digit_pass_kernel(scores_ptr, N, k, hist, state, counter, prog_hist,
                            SHIFT: tl.constexpr, BITS: tl.constexpr, PASS: tl.constexpr,
                            PREV_BITS: tl.constexpr, LAST: tl.constexpr, CHUNK: tl.constexpr,
                            HIST_BINS: tl.constexpr, PASSES: tl.constexpr, SKIP_IDLE: tl.constexpr = True,
                            PDL: tl.constexpr = False):
    """Grid (rows, chunks). Histograms the digit at SHIFT of the entries still in play into
    hist[row, PASS] (relaxed atomics: only their sum matters, and the next launch reads it after
    this grid has finished). state[row, PASS] = (prefix of V's key above SHIFT + BITS, entries of
    the k best still to find among those in play), written by the row's first program for the
    launches after. counter is unused here (one signature for every launch of the op)."""
    wait_for_earlier_grids(PDL)
    row, p, n_prog, _n, ok, key = chunk_keys(scores_ptr, N, CHUNK)
    if PASS == 0:
        prefix = tl.zeros([], dtype=tl.int64)
        k_rem = prefix + k  # (k may arrive as a constant: Triton specialises 1)
    else:
        prefix, k_rem = narrowed(hist, state, row, PASS - 1, PREV_BITS, HIST_BINS, PASSES)
    if p == 0:
        tl.store(state + (row * PASSES + PASS) * 2, prefix)
        tl.store(state + (row * PASSES + PASS) * 2 + 1, k_rem)
    BINS: tl.constexpr = 1 << BITS
    play = ok & ((key >> (SHIFT + BITS)) == prefix)
    digit = ((key >> SHIFT) & (BINS - 1)).to(tl.int32)
    b = tl.arange(0, BINS)
    # After the first pass only the entries sharing the k-th's prefix are in play, often none of
    # a chunk's: such a program skips the histogram (its ballots cost the same masked or not),
    # which is most of a pass's work when many rows fill the GPU.
    if SKIP_IDLE and PASS > 0:
        live = tl.sum(play.to(tl.int32), axis=0) > 0
    else:
        live = True
    if live:
        h = tl.histogram(digit, BINS, mask=play)
        if LAST:  # per-program counts of the last digit, for the select pass's tie order
            tl.store(prog_hist + (row * n_prog + p) * BINS + b, h)
        tl.atomic_add(hist + (row * PASSES + PASS) * HIST_BINS + b, h, mask=h > 0, sem="relaxed")
    elif LAST:
        tl.store(prog_hist + (row * n_prog + p) * BINS + b, tl.zeros([BINS], dtype=tl.int32))


@triton.jit
def radix_select_kernel(scores_ptr, N, k, hist, state, counter, prog_hist, sel,
                        CHUNK: tl.constexpr, KP: tl.constexpr, PP: tl.constexpr, LAST_BITS: tl.constexpr,
                        HIST_BINS: tl.constexpr, PASSES: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (rows, chunks): V and the count of equal entries to take from the last digit pass's
    histogram, then the entries above V (slots from a relaxed atomic counter) and the first equal
    ones in index order into sel[row, :k], unsorted, as keys (score key, reversed index)."""
    wait_for_earlier_grids(PDL)
    row, p, n_prog, n, ok, key = chunk_keys(scores_ptr, N, CHUNK)
    v, need_eq = narrowed(hist, state, row, PASSES - 1, LAST_BITS, HIST_BINS, PASSES)
    n_gt = k - need_eq
    gt = ok & (key > v)
    eq = ok & (key == v)
    pp = tl.arange(0, PP)
    LAST_BINS: tl.constexpr = 1 << LAST_BITS
    before = tl.load(prog_hist + (row * n_prog + pp) * LAST_BINS + (v & (LAST_BINS - 1)), mask=pp < p,
                     other=0)
    eq_rank = tl.sum(before, axis=0) + tl.cumsum(eq.to(tl.int32), axis=0) - 1
    take_eq = eq & (eq_rank < need_eq)
    n_mine = tl.sum(gt.to(tl.int32), axis=0)
    base = tl.atomic_add(counter + row, n_mine, mask=n_mine > 0, sem="relaxed")  # a run of slots
    gt_rank = base + tl.cumsum(gt.to(tl.int32), axis=0) - 1
    full = ((key << 32) | (0xFFFFFFFF - n.to(tl.int64))).to(tl.uint64)  # unique: best, then lowest index
    tl.store(sel + row * KP + gt_rank, full, mask=gt)
    tl.store(sel + row * KP + n_gt + eq_rank, full, mask=take_eq)


@triton.jit
def radix_rank_kernel(scores_ptr, N, k, hist, counter, sel, vals_ptr, idx_ptr, entries_ptr, W,
                      KP: tl.constexpr, RANK_BLOCK: tl.constexpr, CMP_BLOCK: tl.constexpr,
                      HIST_BINS: tl.constexpr, PASSES: tl.constexpr, LISTED: tl.constexpr = False,
                      PDL: tl.constexpr = False):
    """Grid (rows, k / RANK_BLOCK): the place of each selected key in the output is the number of
    selected keys above it (the keys are unique), counted against all k in CMP_BLOCK steps; then
    index and value go to that place. Many programs counting replace one program sorting (a
    4-warp bitonic tl.sort of 512 keys took most of the select launch's 9 us under ncu, H200
    2026-12-03). The row's first program clears the histograms and the slot counter for the
    next call: every launch that reads them has finished by now. LISTED: entry ids out
    (keys.write_picks), the row's columns past k padded by its first program."""
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    r = p * RANK_BLOCK + tl.arange(0, RANK_BLOCK)
    keep = r < k
    mine = tl.load(sel + row * KP + r, mask=keep, other=0, cache_modifier=".cg")
    rank = place_among(mine, sel + row * KP, k, CMP_BLOCK)
    index = (0xFFFFFFFF - (mine & 0xFFFFFFFF)).to(tl.int64)
    write_picks(scores_ptr, vals_ptr, idx_ptr, row, N, k, rank, index, keep, entries_ptr, W, LISTED)
    if p == 0:
        clear_histograms(hist, row, HIST_BINS, PASSES)
        tl.store(counter + row, 0)
        pad_listed_row(idx_ptr, row, k, W, LISTED)


class StableTopkLauncher(LauncherBase):
    """Holds the histograms, states, slot counters and selection buffers (self-clearing, so the
    launches capture into a CUDA graph); one instance per device/stream, calls on it must not
    overlap. Overrides (sweeps): DIGITS, CHUNK, num_warps, MAX_K, RANK_BLOCK, CMP_BLOCK, PDL
    (False: plain launches), SKIP_IDLE (False: every program of a digit pass builds its histogram);
    the block-max form's FORM, BLOCK, COLLECT ('live' or 'chunk'), LIVE_BLOCKS (live blocks read
    per step of the live collect, or 'rounds': _live_blocks), BM_CHUNK (blocks per program of its first
    launch), BM_WARPS (its warps, num_warps unless set), COLLECT_WARPS (the collect's:
    _collect_warps) and TIES ('chunk' or 'rank': which programs of the rank launch write the
    entries tied at T) and PASS_LAUNCH ('fused' or 'each': the digit passes over the maxima in one
    launch or a launch each) with PASS_WARPS (the fused launch's warps: _pass_warps) and
    EARLY_SLACK (its stop: _early_slack), and RANK_COVER (its rank launch's programs for
    RANK_COVER x k candidates) with RANK_WARPS (their warps: 1 by default from RANK_ONE_WARP_ROWS
    rows, else num_warps), RANK_TILE and RANK_AHEAD (True: keys.place_among's TILE / AHEAD, how a
    rank step loads its keys: _rank_load) and TIE_STEP (entries of a chunk their tie path reads at
    a time: _tie_step); INDEX_MAXIMA (True: maxima_block offers the listed index launch's block
    maxima, listed_ids_with_maxima)."""

    MAX_PROGRAMS = 1024  # per row: the select pass reads every program's tie count in one load
    # the override names the launcher reads (the docstring's list), for callers that check theirs
    OVERRIDES = frozenset({"DIGITS", "CHUNK", "num_warps", "MAX_K", "RANK_BLOCK", "CMP_BLOCK", "PDL",
                           "SKIP_IDLE", "FORM", "BLOCK", "COLLECT", "LIVE_BLOCKS", "BM_CHUNK", "TIES",
                           "PASS_LAUNCH", "PASS_WARPS", "RANK_COVER", "EARLY_SLACK", "RANK_WARPS",
                           "BM_WARPS", "COLLECT_WARPS", "RANK_TILE", "RANK_AHEAD", "TIE_STEP",
                           "INDEX_MAXIMA"})

    def __init__(self, sm_count: int | None = None, overrides: dict | None = None):
        super().__init__(sm_count, overrides)
        self._resident: dict = {}  # (build key, live blocks a step) -> programs the GPU holds at once

    def _workspace(self, device, rows: int, n_prog: int, kp: int, passes: tuple) -> dict:
        def fits(ws):
            return (ws["state"].shape[0] >= rows and ws["prog_hist"].shape[1] >= n_prog
                    and ws["sel"].shape[1] >= kp)

        def make():
            r, n, k = (max(rows, 1), max(n_prog, 1), max(kp, 1))
            bins = 1 << max(bits for _, bits in passes)
            return {"hist": torch.zeros(r, len(passes), bins, dtype=torch.int32, device=device),
                    "counter": torch.zeros(r, dtype=torch.int32, device=device),
                    "state": torch.empty(r, len(passes), 2, dtype=torch.int64, device=device),
                    "prog_hist": torch.empty(r, n, 1 << passes[-1][1], dtype=torch.int32, device=device),
                    "sel": torch.empty(r, k, dtype=torch.uint64, device=device)}

        return self._reuse_or_make((device, passes), fits, make)

    def __call__(self, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._select(scores, k)

    def listed_ids(self, scores_BSP: torch.Tensor, entries_BSP: torch.Tensor, k: int,
                   n: int) -> torch.Tensor:
        """The reference's signature (model/csa2_ops.py:select_listed_topk, its top-k and picks
        being this launcher's): a listed pool's scores [B, S, P] and its ids [B, S, P] (int32 /
        int64) over n entries -> the top-k's picks as entry ids [B, S, min(k, n)] int64, -1 for
        padding picked and past the top-k's min(k, P) columns. The rank launch writes the ids
        itself, where the top-k and then listed_picks would take a launch more (and its wait) and
        a round trip of the values and positions. A list can hold at most the n entries (P <= n,
        as the model sizes it), or its picks would not fit min(k, n) columns."""
        return self._listed(scores_BSP, entries_BSP, k, n)

    def _listed(self, scores_BSP, entries_BSP, k: int, n: int, maxima: torch.Tensor | None = None):
        """listed_ids, with the scores' block maxima flat [rows * M] where given."""
        op = "StableTopk(listed)"
        check_shape(op, "scores", scores_BSP, (None, None, None))
        check_dtype(op, "entries", entries_BSP, (torch.int32, torch.int64))
        require(entries_BSP.shape == scores_BSP.shape,
                f"{op}: entries {tuple(entries_BSP.shape)} must match the scores {tuple(scores_BSP.shape)}")
        k_out, width = min(k, scores_BSP.shape[-1]), min(k, n)
        require(width >= k_out, f"{op}: a list of {scores_BSP.shape[-1]} entries over n = {n}: the "
                f"top-k's {k_out} columns exceed min(k, n) = {width}")
        return self._select(scores_BSP, k, entries_BSP, width, maxima)

    def maxima_block(self, rows: int, p: int, k: int) -> int:
        """The run of slots whose maxima listed_ids_with_maxima takes with `rows` lists of p
        scores for this k: the block-max form's block where that form runs with its digit passes
        in one program per row (_form, _pass_launch; a listed pool of 16K at k = 512: 8 from 16
        rows), else 0 (the top-k computes what it needs from the scores). 0 as well unless the
        override INDEX_MAXIMA is True (INDEX_MAXIMA_DEFAULT)."""
        use = self._overrides.get("INDEX_MAXIMA", INDEX_MAXIMA_DEFAULT)
        require(isinstance(use, bool), f"StableTopk: INDEX_MAXIMA must be a boolean, got {use!r}")
        k_out = min(k, p)
        if not use or rows < 1 or k_out < 1 or next_pow2(k_out) > self._overrides.get("MAX_K", 8192) \
                or p >= 2**31:
            return 0
        form, block = self._form(p, k_out, self._overrides.get("BLOCK", PREFILTER_BLOCK), rows)
        passes = digit_passes(tuple(self._overrides.get("DIGITS", DIGITS)))
        if form != "prefilter" or self._pass_launch(cdiv(p, block), passes) != "fused":
            return 0
        return block

    def listed_ids_with_maxima(self, scores_BSP: torch.Tensor, maxima_BSM: torch.Tensor,
                               entries_BSP: torch.Tensor, k: int, n: int) -> torch.Tensor:
        """listed_ids over scores whose block maxima came with them: maxima [B, S, cdiv(P, block)]
        for the block maxima_block gives (csa2_index_score_pooled_maxima writes them in the index
        launch), so the block-max form skips its first launch and the fused passes do its digit
        pass. The maxima must be those of these scores (stable_topk/reference.py:block_maxima):
        the selection is exact only then. A ValueError names a shape or block that does not fit."""
        op = "StableTopk(listed, maxima)"
        check_shape(op, "scores", scores_BSP, (None, None, None))
        check_dtype(op, "maxima", maxima_BSM, (torch.float32,))
        rows, p = scores_BSP.shape[0] * scores_BSP.shape[1], scores_BSP.shape[2]
        block = self.maxima_block(rows, p, k)
        require(block > 0, f"{op}: {rows} rows of {p} scores at k = {k} take no block maxima "
                f"(maxima_block is 0)")
        want = (*scores_BSP.shape[:2], cdiv(p, block))
        require(tuple(maxima_BSM.shape) == want, f"{op}: maxima {tuple(maxima_BSM.shape)} must be {want} "
                f"(runs of {block} of the scores' {p})")
        check_device(op, scores=scores_BSP, maxima=maxima_BSM)
        return self._listed(scores_BSP, entries_BSP, k, n, maxima_BSM.contiguous().view(-1))

    def _select(self, scores: torch.Tensor, k: int, entries: torch.Tensor | None = None,
                width: int | None = None, maxima: torch.Tensor | None = None):
        """(values, indices) of the top-k, or with `entries` the listed form's ids (listed_ids);
        `maxima`: the scores' block maxima, flat (listed_ids_with_maxima)."""
        op = "StableTopk"
        check_dtype(op, "scores", scores, (torch.float32,))
        require(scores.dim() >= 1 and k >= 1, f"{op}: needs scores [..., N] and k >= 1, got "
                f"{tuple(scores.shape)} and k={k}")
        check_device(op, scores=scores)
        n = scores.shape[-1]
        k_out = min(k, n)
        lead = scores.shape[:-1]
        rows = scores.numel() // max(n, 1)
        listed = entries is not None
        if n == 0 or rows == 0 or next_pow2(k_out) > self._overrides.get("MAX_K", 8192) or n >= 2**31:
            # the rank pass compares every selected key with every other (k^2), and keys pack
            # 32-bit indices: past those, the sort (and no work for an empty row)
            empty = (scores.new_empty(*lead, 0), scores.new_empty(*lead, 0, dtype=torch.int64))
            vals, idx = stable_topk_reference(scores, k) if n and rows else empty
            return reference_listed_picks(vals, idx, entries, width) if listed else (vals, idx)
        kp = next_pow2(k_out)
        passes = digit_passes(tuple(self._overrides.get("DIGITS", DIGITS)))
        # 512-entry chunks (H200 at 128K: 14.3 us, 1K 15.4 in session 9; 23.7 / 25.4 / 28.8 us for
        # 512 / 1K / 2K before the rank pass); they grow for very long rows, so a row has at most
        # MAX_PROGRAMS, and for many rows (batch_chunk)
        chunk = self._overrides.get("CHUNK") or batch_chunk(rows, n)
        require(chunk >= 16 and chunk & (chunk - 1) == 0,
                f"StableTopk: CHUNK must be a power of two of at least 16, got {chunk}")
        chunk = max(chunk, next_pow2(cdiv(n, self.MAX_PROGRAMS)))
        n_prog = cdiv(n, chunk)
        # keys per rank program: 4 on few rows (H200 at 128K, one row, radix form: 14.3 us; 8 keys
        # 14.8, 16 keys 15.0, 32 keys 16.0), more on many (rank_block_for); compared 256 at a time
        # (the block-max form's from RANK_ONE_WARP_ROWS rows: 128)
        rank_block = self._pow2("RANK_BLOCK", rank_block_for(rows, k_out))
        cmp_block = self._pow2("CMP_BLOCK", 256)
        flat = scores.contiguous().view(rows, n)
        # the listed form writes ids only, into rows of `width` (no values: its launches get the ids'
        # buffer in their place, never written through it)
        idx = torch.empty(rows, width if listed else k_out, dtype=torch.int64, device=scores.device)
        vals = idx if listed else torch.empty(rows, k_out, dtype=torch.float32, device=scores.device)
        ids = entries.contiguous().view(rows, n) if listed else idx
        out = {"entries": ids, "width": width if listed else k_out, "listed": listed}
        warps = self._overrides.get("num_warps", 4)
        form, block = self._form(n, k_out, self._overrides.get("BLOCK", PREFILTER_BLOCK), rows)
        if form == "prefilter":
            self._block_max_form(flat, k_out, vals, idx, passes, chunk, block, warps, (rank_block, cmp_block),
                                 out, maxima)
            return idx.view(*lead, width) if listed else (vals.view(*lead, k_out), idx.view(*lead, k_out))
        ws = self._workspace(scores.device, rows, n_prog, kp, passes)
        hist, state, counter = ws["hist"], ws["state"], ws["counter"]
        common = dict(CHUNK=chunk, HIST_BINS=hist.shape[2], PASSES=len(passes), num_warps=warps,
                      **pdl_launch_args(scores.device, self._overrides))
        for i, (shift, bits) in enumerate(passes):
            radix_digit_pass_kernel[(rows, n_prog)](
                flat, n, k_out, hist, state, counter, ws["prog_hist"], SHIFT=shift, BITS=bits, PASS=i,
                PREV_BITS=passes[i - 1][1] if i else 1, LAST=i == len(passes) - 1,
                SKIP_IDLE=self._overrides.get("SKIP_IDLE", True), **common)
        radix_select_kernel[(rows, n_prog)](
            flat, n, k_out, hist, state, counter, ws["prog_hist"], ws["sel"], KP=ws["sel"].shape[1],
            PP=next_pow2(n_prog), LAST_BITS=passes[-1][1], **common)
        rank_block = min(rank_block, kp)
        common.pop("CHUNK")
        radix_rank_kernel[(rows, cdiv(k_out, rank_block))](
            flat, n, k_out, hist, counter, ws["sel"], vals, idx, out["entries"], out["width"],
            KP=ws["sel"].shape[1], RANK_BLOCK=rank_block, CMP_BLOCK=min(cmp_block, ws["sel"].shape[1]),
            LISTED=listed, **common)
        return idx.view(*lead, width) if listed else (vals.view(*lead, k_out), idx.view(*lead, k_out))

    def _pow2(self, name: str, default: int) -> int:
        """The override `name`, or `default`: a power of two (tl.arange's sizes), or a ValueError
        naming it before any launch (a launch left half done would leave its counters set)."""
        value = self._overrides.get(name, default)
        require(is_pow2(value), f"StableTopk: {name} must be a power of two, got {value!r}")
        return value

    def _form(self, n: int, k_out: int, block: int, rows: int) -> tuple[str, int]:
        """(form, block): "radix" or "prefilter" (prefilter.py, over blocks of `block` entries),
        the override FORM if given.

        The block-max form needs at least k maxima; by default it serves rows of at least 4k blocks:
        with fewer, most entries can lie above the k-th maximum, and the rank compares all of them
        with each other. Rows short of 4k blocks of `block` that have 4k blocks of half as many
        take that half block from SMALL_BLOCK_ROWS rows, unless BLOCK is set (a Reindex layer's
        listed pool: 16K entries, 2,048 blocks of 8 for k = 512). Sweeps, k = 512, the index
        kernel's scores, graph replay (bench_layer_batch.py --topk-blocks, us):
        - H200, 2026-12-04, for 1 / 8 / 64 rows: 128K entries, radix 17.1 / 36.3 / 173.4, blocks of
          8 13.7 / 23.7 / 105.4, of 16 13.4 / 24.1 / 99.3, of 32 13.4 / 23.0 / 96.5; a listed pool
          of 16K: radix 10.9 / 16.1 / 47.6, blocks of 8 12.6 / 14.8 / 41.2, of 32 (512 blocks, = k)
          31.0 / 92.3 / 501.5;
        - a listed pool of 16K, 2026-12-06: H200 for 1 / 4 / 16 / 64 / 128 rows, radix 10.9 / 12.0
          / 24.5 / 43.8 / 71.0, blocks of 8 12.3 / 13.7 / 19.7 / 33.7 / 57.1; H100 for 4 / 8 / 16
          / 64 rows, radix 12.2 / 13.9 / 24.6 / 43.4, blocks of 8 13.8 / 15.3 / 19.6 / 33.5, of 16
          14.2 / 16.5 / 20.5 / 34.5. At 8 rows the cards disagree: from 16 both gain.

        Measured and dropped (session 37, commits 03dc5e2-d8a0cab): a row form, one program per
        row of up to 16K entries doing the whole select in registers (the block-max bound, digit
        passes over the maxima and then over the candidates, a rank of the k picks against each
        other). Exact, and 61-63 us flat on the H200 at 1-128 rows of a listed pool; on an H100 at
        64 rows: load 1.2 us, maxima and their passes 8.6, the candidates' scan over 16K entries
        13.7, their passes 5.5, the rank 32.5 (docs/benchmarks.md, session 37)."""
        form = self._overrides.get("FORM")
        require(form in (None, "radix", "prefilter"),
                f"StableTopk: FORM must be 'radix' or 'prefilter', got {form!r}")
        require(2 <= block <= 512 and block & (block - 1) == 0,
                f"StableTopk: BLOCK must be a power of two in 2..512, got {block}")
        blocks = cdiv(n, block)
        if form is None:
            half = block // 2
            if (blocks < 4 * k_out and "BLOCK" not in self._overrides and rows >= SMALL_BLOCK_ROWS
                    and half >= 2 and cdiv(n, half) >= 4 * k_out):
                return "prefilter", half
            form = "prefilter" if blocks >= 4 * k_out else "radix"
        return (form if blocks >= k_out else "radix"), block

    def _pass_launch(self, m: int, passes: tuple) -> str:
        """How the block-max form runs its digit passes after the first over a row's m maxima:
        "fused" (prefilter.maxima_passes_kernel: one program per row holds them all and does every
        pass) or "each" (a launch per digit, programs over chunks of the maxima); the override
        PASS_LAUNCH if given. Fused by default up to FUSED_PASS_BLOCKS maxima a row (a listed
        pool's 2,048 blocks of 8), for schedules of up to 8 digits (their widths pack into one
        32-bit constant).

        Measured and dropped (session 48, commit e38b4bb): a "row" launch, one program per row of
        up to 16K entries (8 warps) for the maxima, every digit pass and the collect, keying the
        candidates from its registers with slots from a scan over the block counts (no atomics),
        so the rank was the only other launch. Exact (H100: the GPU top-k and listed tests, 111
        passed), and slower: 27.4 us against 22.1 at 32 rows of a listed pool, 32.6 against 27.3 at
        64, 49.3 against 45.9 at 128 (the best of 4 / 8 / 16 warps and collect steps of 128 / 256 /
        512 blocks: 26.3 / 30.7 / 47.6); under the profiler it ended 28.7 us after the index, where
        the three launches it replaced end 14.4 us after it. As session 37's one-program form
        (_form), one SM per row runs the scans and histograms that the launches spread over all of
        them (docs/benchmarks.md, session 48)."""
        launch = self._overrides.get("PASS_LAUNCH", "fused" if m <= FUSED_PASS_BLOCKS else "each")
        require(launch in ("fused", "each"),
                f"StableTopk: PASS_LAUNCH must be 'fused' or 'each', got {launch!r}")
        return launch if len(passes) <= 8 else "each"

    def _early_slack(self, k_out: int) -> int:
        """The fused passes' stop (prefilter.maxima_passes_kernel's SLACK): blocks a digit may hold
        beyond those it needs, or -1 for no stop (every pass, T exact); the override EARLY_SLACK
        (an int >= 0, or "off") if given. Default k / 16 blocks: at most k / 2 more entries of
        blocks of 8 to rank, most of them below the digit's range. Under the profiler the fused
        program without it ran 9.1 us after the maxima at 32 rows of a listed pool (H100, session
        47), nearly all of it the three passes' histograms and barriers, of which the stop
        typically skips two; with it 5.4-5.5 us. H100 sweep of a listed pool's top-k (16K, k = 512;
        bench_layer_batch.py --topk-sweep, session 48), us for k / 16 (default) / off / 0 / 128 blocks:
        16 rows 17.1 / 20.3 / 19.2 / 17.1, 32 rows 22.0 / 24.5 / 24.4 / 22.0, 64 rows 27.3 / 32.6 /
        31.0 / 28.7, 128 rows 45.8 / 47.6 / 46.8 / 49.0."""
        slack = self._overrides.get("EARLY_SLACK", max(k_out // 16, 1))
        require(slack == "off" or (isinstance(slack, int) and not isinstance(slack, bool) and 0 <= slack),
                f"StableTopk: EARLY_SLACK must be an int >= 0 or 'off', got {slack!r}")
        return -1 if slack == "off" else min(slack, k_out)

    def _rank_shape(self, rows: int, warps: int, cmp_block: int) -> tuple[int, int]:
        """(warps, keys compared at a time) of the block-max form's rank programs over `rows` rows:
        (1, 64) from RANK_ONE_WARP_ROWS up to RANK_TILE_MAX_ROWS rows (with _rank_load's tile
        loads a step ahead), (1, 128) above, else the launch's (warps, cmp_block); the overrides
        RANK_WARPS and CMP_BLOCK if given (see _block_max_form). The kernel's tie path (the
        entries tied at T, TIES_IN_RANK) holds a CHUNK of entries in the one warp: at chunks of
        2,048 (rows of 128K from 64 rows) the sm_90 build takes 229 registers a thread, so an SM
        holds 8 programs instead of 32 (72 registers at a listed pool's 512); the Full layer's
        top-k still gained there (H100, session 48: 53.7 against 57.1-58.0 us at 64 rows)."""
        if rows < RANK_ONE_WARP_ROWS:
            return self._pow2("RANK_WARPS", warps), cmp_block
        return self._pow2("RANK_WARPS", 1), self._pow2("CMP_BLOCK", 64 if rows <= RANK_TILE_MAX_ROWS else 128)

    def _rank_load(self, rows: int) -> dict:
        """How the block-max form's rank steps load their keys (keys.place_among's TILE / AHEAD):
        straight into the compare's tile, the next step's a step ahead, from RANK_ONE_WARP_ROWS up
        to RANK_TILE_MAX_ROWS rows; as a vector, in turn, elsewhere; the overrides RANK_TILE and
        RANK_AHEAD if given. H100 sweeps (bench_layer_batch.py --topk-sweep, session 52, two runs
        at 32 and 64 rows), a listed pool's top-k (16K, k = 512), us at 16 / 32 / 64 / 128 rows
        with both and 64-key steps: 14.0 / 17.7 / 21.4 / 39.6 against 15.0 / 18.9 / 23.4 / 35.9
        loaded as a vector 128 at a time; the listed Reindex layers 0.6-1.2 us faster at 16-64 rows
        than with the Gluon attention's same launch and the former load (bf16 keys 64.0 / 97.3 /
        153.1 us against 64.6 / 98.2 / 154.0, FP4 keys 50.8 / 71.4 / 103.2 against 51.4 / 72.1 /
        104.4); a Full layer's (128K) top-k 29.5 / 45.2 against 29.7 / 45.8 at 32 / 64 rows. Below
        16 rows, where the rank programs take the launch's warps, not timed."""
        on = RANK_ONE_WARP_ROWS <= rows <= RANK_TILE_MAX_ROWS
        load = {"RANK_TILE": self._overrides.get("RANK_TILE", on),
                "RANK_AHEAD": self._overrides.get("RANK_AHEAD", on)}
        for name, value in load.items():
            require(isinstance(value, bool), f"StableTopk: {name} must be True or False, got {value!r}")
        return load

    def _pass_warps(self, rows: int) -> int:
        """Warps of the fused passes' program (one a row, maxima_passes_kernel): 4 from
        PASS_FOUR_WARP_ROWS rows, else 8; the override PASS_WARPS if given. Its code is mostly
        tl.histogram's ballots and popcounts, unrolled over the maxima a thread holds (sm_90 build
        at 2,048 maxima: 4 warps 3,560 SASS instructions a thread, 8 warps 1,952, 16 warps 1,368; no
        spills). Before the early stop, the one-warp rank and collect, 8 warps won (H100, session
        47, us for 8 / 4 / 16 warps: 32 rows 23.1 / 24.3 / 25.0, 64 rows 29.5 / 30.7 / 31.9). With
        them the stop skips most passes and 4 warps win (H100 sweeps of a listed pool's top-k, two
        runs of session 49, us for 8 / 4 / 2 warps): 8 rows 13.6 / 13.5 / 13.5, 16 rows 14.6 /
        14.7 / 16.2, 32 rows 19.4 / 18.9 / 20.7, 48 rows 22.6 / 22.5 / 24.4, 64 rows 24.2 / 23.3 /
        24.4, 128 rows 39.8 / 37.6 / 38.7. Fewer rows keep 8 (not measured there)."""
        return self._pow2("PASS_WARPS", 4 if rows >= PASS_FOUR_WARP_ROWS else 8)

    def _collect_warps(self, collect: str, warps: int) -> int:
        """Warps of the block-max form's collect programs: one for the live collect (2 rows and
        more), the launch's num_warps for whole chunks (one row); the override COLLECT_WARPS if
        given. A live program's steps each scan LIVE_BLOCKS flags and append the blocks in play:
        in one warp the scans and the slot counts need no barrier (sm_90 builds at 1 / 2 / 4 warps:
        888 / 608 / 488 SASS instructions with 9 / 23 / 23 barriers). H100 sweeps of the top-k
        (bench_layer_batch.py --topk-sweep, two runs of session 49, bit-exact against the
        reference first), us for 4 warps (the former default) / 1 warp: 128K scores of a Full
        layer at 2 / 4 / 8 / 16 / 32 / 64 / 128 rows 15.1 / 19.0 / 22.5 / 24.8 / 34.6 / 54.3 / 96.3
        against 14.2 / 17.2 / 21.7 / 24.3 / 32.0 / 50.2 / 87.7; a listed pool's 16K at 16 / 32 /
        64 / 128 rows 14.8 / 21.0 / 25.3 / 40.1 against 14.8 / 19.2 / 24.4 / 39.7 (at 16 rows
        15.2-15.3 against 14.8 in two other calls: the one loss). One row's chunk
        collect lost with one warp (12.2 against 13.0 us) and keeps num_warps. Registers, sm_90
        builds: 72 a thread at a listed pool's chunks of 512 in blocks of 8, 142 at a Full layer's
        2,048 in blocks of 16 (batch_chunk from 16 rows of 128K), no spills; 4 warps 40 / 64."""
        return self._pow2("COLLECT_WARPS", 1 if collect == "live" else warps)

    def _tie_step(self, chunk: int) -> int:
        """Entries of a chunk the rank programs' tie path reads at a time (prefilter._write_ties):
        TIE_STEP (512) of chunks of at least TIE_STEP_CHUNK (2,048: a Full layer's 128K from 16
        rows, a listed pool's 16K from 96), else the whole chunk; the override TIE_STEP if given
        (at most the chunk). The path runs only on rows with fewer than k candidates above T, but
        its registers are the whole program's. sm_90 one-warp builds, registers a thread: a Full
        layer's at chunks of 2,048: 227 whole, 160 / 90 / 72 / 67 in steps of 1,024 / 512 / 256
        / 128 (an SM holds 8 programs whole, 21 in steps of 512); a listed pool's at chunks of 512
        / 1,024 / 2,048: 72 / 159 / 245 whole, 63 in steps of 256. H100 sweeps of the top-k
        (bench_layer_batch.py --topk-sweep, session 50, two runs), us for whole chunks / steps of
        256 / 512 / 1,024: Full 128K at 16 / 32 / 48 / 64 / 96 / 128 rows 24.1 / 32.1 / 38.2 /
        47.5 / 66.0 / 80.7, steps of 512 22.4 / 29.9 / 37.5 / 45.6 / 64.6 / 78.5 (256: 24.2 / 30.6
        / 39.3 / 46.2 / 67.1 / 78.7; 1,024: 24.1 / 31.9 / 38.0 / 47.4 / 65.4 / 80.1); a listed pool
        at 96 / 128 rows 34.5 / 37.9, steps of 512 33.0 / 35.9. On the listed pool's shorter chunks
        steps lose (64 rows, chunks of 1,024: 23.4 whole, 24.8 in steps of 512, 27.6 of 256): its
        rows often have ties at T, which steps read one after another."""
        return min(self._pow2("TIE_STEP", TIE_STEP if chunk >= TIE_STEP_CHUNK else chunk), chunk)

    def _live_blocks(self, programs: int, args: tuple, consts: dict) -> int:
        """Live blocks a step of the live collect over a grid of `programs` where LIVE_BLOCKS is
        "rounds" (live_steps.LIVE_BLOCKS_DEFAULT unless overridden): live_steps.live_blocks_for,
        from how many programs of each build the GPU holds (plugins/coresident.py), compiled
        without a launch once per configuration and remembered. The most (32) under the
        interpreter (no builds to count)."""
        if interpreting():
            return LIVE_STEP_CHOICES[0]
        device = args[0].device
        # what changes a build: the constants, and the ints Triton specializes on (multiples of 16, ones)
        key = (device, tuple(sorted(consts.items())),
               tuple((a % 16 == 0, a == 1) for a in args if isinstance(a, int)))

        def resident_of(blocks: int) -> int:
            if (key, blocks) not in self._resident:
                compiled = prefilter_collect_live_kernel.warmup(*args, grid=(1, 1), LIVE_BLOCKS=blocks,
                                                                **consts)
                self._resident[key, blocks] = resident_programs(compiled, device)
            return self._resident[key, blocks]

        return live_blocks_for(programs, resident_of)

    def _block_max_form(self, flat: torch.Tensor, k_out: int, vals: torch.Tensor, idx: torch.Tensor,
                        passes: tuple, chunk: int, block: int, warps: int, rank: tuple[int, int],
                        out: dict, maxima: torch.Tensor | None = None) -> None:
        """prefilter.py's launches into vals / idx [rows, k_out]. `chunk` (entries per program of
        the collect and tie launches, as the radix form's) also sets the first launch's blocks per
        program (chunk / block maxima: as many scores as a radix pass's program reads); `rank` is
        the rank launch's (keys per program, keys compared at a time below RANK_ONE_WARP_ROWS rows);
        `out` the listed form's (entries, width, listed) for it (_select); `maxima` the rows' block
        maxima, flat [rows * M], where they came with the scores (listed_ids_with_maxima): then
        the first launch does not run, and the fused passes do its digit pass."""
        rows, n = flat.shape
        m = cdiv(n, block)
        chunk = max(chunk, block)  # whole blocks per collect program
        n_prog = cdiv(n, chunk)
        # the collect launch over the live blocks from 2 rows; one row reads its 512 KB of scores
        # in one round trip per program, which the live form's three (maxima, list, live scores)
        # do not beat (H200 at 128K, k = 512, us for 1 / 8 / 64 rows: whole chunks 13.3 / 23.8 /
        # 99.4, live blocks 13.9 / 19.8 / 77.5; docs/benchmarks.md, session 27)
        collect = self._overrides.get("COLLECT", "chunk" if rows == 1 else "live")
        require(collect in ("live", "chunk"),
                f"StableTopk: COLLECT must be 'live' or 'chunk', got {collect!r}")
        # warps of the first launch's programs (sweeps; the launch's num_warps unless set) and of
        # the collect's (_collect_warps). sm_90 builds at 1 / 2 / 4 warps: the first launch (64
        # blocks of 8) 1,648 / 880 / 496 SASS instructions with 3 / 4 / 4 barriers. Its width
        # stays num_warps: H100 sweeps (session 49, 128K, the collect in one warp) found 2 warps
        # 0.5-1.3 us faster at 4, 8, 16 and 32 rows and 1.1-5.6 us slower at 24, 40, 48 and 64
        bm_warps, collect_warps = self._pow2("BM_WARPS", warps), self._collect_warps(collect, warps)
        # live blocks a step of the live collect: a power of two, checked here before any launch, or
        # "rounds" (None here): chosen from the collect's grid when it launches (_live_blocks)
        live_blocks = self._overrides.get("LIVE_BLOCKS", LIVE_BLOCKS_DEFAULT)
        require(live_blocks == "rounds" or is_pow2(live_blocks),
                f"StableTopk: LIVE_BLOCKS must be a power of two or 'rounds', got {live_blocks!r}")
        live_blocks = None if live_blocks == "rounds" else live_blocks
        # the entries tied at T (needed on rows with fewer than k entries above it) written by one
        # program per chunk ("chunk"), or by the rank programs after their ranks ("rank": the
        # launch holds no program for them; at 64 rows of 128K, 4,096 of its 6,144 are such).
        # H100 sweep (bench_layer_batch.py --topk-ties, 2026-12-05), k = 512 of 128K, us for
        # chunk / rank: 64 rows, Full scores 60.3 / 56.8, Reindex 60.6 / 57.3, listed pool
        # 34.4 / 34.6; one row 13.7 / 13.4, 13.8 / 13.6, 13.1 / 12.8
        ties = self._overrides.get("TIES", "rank")
        require(ties in ("chunk", "rank"), f"StableTopk: TIES must be 'chunk' or 'rank', got {ties!r}")
        ties_in_rank = ties == "rank"
        # the rank programs take the G candidates RANK_BLOCK at a time, strided; G is known on the
        # GPU only, and is often a little over k (random scores in blocks of 8: ~1.13k), so
        # programs for k alone leave a few of them a second round of the whole chain of loads.
        # RANK_COVER x k candidates take one round (programs past G exit at once). H100 sweep of a
        # listed pool's top-k (bench_layer_batch.py --topk-sweep, 2026-12-07), us for cover 2 / 1 /
        # 4: 32 rows 23.1 / 26.2 / 29.1, 64 rows 29.5 / 33.3 / 34.9, 128 rows 48.0 / 57.2
        cover = self._overrides.get("RANK_COVER", 2)
        require(cover in (1, 2, 4), f"StableTopk: RANK_COVER must be 1, 2 or 4, got {cover!r}")
        # a rank program's warps and keys compared at a time (_rank_shape): from RANK_ONE_WARP_ROWS
        # rows one warp comparing 128 (an SM holds 32 such programs, so 32 rows' 4,096 fit in one
        # round of the slots, and the counts add up within the warp: no barrier), else the
        # launch's num_warps comparing 256. H100 sweeps of a listed pool's top-k (16K, k = 512;
        # bench_layer_batch.py --topk-sweep, two runs of session 48), us at 16 / 32 / 64 / 128 rows:
        # 1 warp x 128 14.8 / 21.4 / 25.4 / 40.3, 4 warps x 256 (the former default) 17.1 / 22.0 /
        # 27.1 / 45.7; 1 x 256 18.3 / 24.7 / 28.2 / 43.9, 1 x 64 15.9 / 20.2 / 28.3 / 44.6, 2 x 256
        # 18.8 / 22.0 / 28.4 / 47.7, 2 x 128 17.6 / 20.6 / 29.7 / 48.1, 8 x 256 22.7 / 30.0 / 41.8 /
        # 64.5. Fewer rows keep the former (not measured there: one row's rank is a few programs'
        # latency)
        rank_warps, cmp_block = self._rank_shape(rows, warps, rank[1])
        # how the rank steps load their keys (_rank_load). The listed rank at 32 rows ended 8.35 us
        # after the collect with its keys loaded in turn (H100, session 49's timeline), where its
        # compares come to 1-3 us by instruction count (a row's ~600-900 candidates each against
        # all); the rest was, as far as counts tell, the waits of its chain of loads
        rank_load = self._rank_load(rows)
        tie_step = self._tie_step(chunk)
        pass_warps = self._pass_warps(rows)
        fused = self._pass_launch(m, passes) == "fused"
        slack = self._early_slack(k_out) if fused else -1
        # above (k - 1) x block entries cannot be above T (prefilter.py); a list of twice that lets
        # the fused passes stop at a digit of up to k blocks more than it needs (maxima_passes_kernel)
        cap = k_out * block * (2 if slack >= 0 else 1)
        # blocks per program of the first launch: as many scores as a digit pass's program reads.
        # At 64 rows of 128K it read its 32 MB at 2.4 TB/s (13.5 us, session 24): BM_CHUNK sweeps
        # the bytes per program (bench_layer_batch.py --topk-first)
        bm_chunk = self._pow2("BM_CHUNK", max(chunk // block, 16))
        pass_chunk = max(batch_chunk(rows, m), next_pow2(cdiv(m, self.MAX_PROGRAMS)))
        bins = 1 << max(bits for _, bits in passes)

        def fits(ws):
            return (ws["bm"].shape[0] >= rows and ws["bm"].shape[1] >= m and ws["prog_eq"].shape[1] >= n_prog
                    and ws["cand"].shape[1] >= cap)

        def make():
            r = max(rows, 1)
            return {"hist": torch.zeros(r, len(passes), bins, dtype=torch.int32, device=flat.device),
                    "counter": torch.zeros(r, dtype=torch.int32, device=flat.device),
                    "state": torch.empty(r, len(passes), 2, dtype=torch.int64, device=flat.device),
                    "tval": torch.empty(r, dtype=torch.int64, device=flat.device),
                    "bm": torch.empty(r, next_pow2(m), dtype=torch.float32, device=flat.device),
                    "live": torch.empty(r, next_pow2(m), dtype=torch.int32, device=flat.device),
                    "prog_eq": torch.empty(r, next_pow2(n_prog), dtype=torch.int32, device=flat.device),
                    "cand": torch.empty(r, next_pow2(cap), dtype=torch.uint64, device=flat.device)}

        ws = self._reuse_or_make((flat.device, passes, "prefilter"), fits, make)
        hist, state, counter = ws["hist"], ws["state"], ws["counter"]
        cand_cap = ws["cand"].shape[1]
        common = dict(HIST_BINS=bins, PASSES=len(passes), num_warps=warps,
                      **pdl_launch_args(flat.device, self._overrides))
        require(maxima is None or (fused and maxima.numel() == rows * m),
                f"StableTopk: block maxima given for a launch that does not take them ({rows} rows of "
                f"{m} blocks, fused passes {fused})")
        if maxima is None:
            bm = ws["bm"].view(-1)[:rows * m]  # dense [rows, m]: the kernels index it so
            shift, bits = passes[0]
            block_max_pass_kernel[(rows, cdiv(m, bm_chunk))](
                flat, n, m, k_out, hist, state, counter, bm, SHIFT=shift, BITS=bits, CHUNK=bm_chunk,
                BLOCK=block, **(common | {"num_warps": bm_warps}))
        else:
            bm = maxima
        if fused:
            maxima_passes_kernel[(rows,)](
                bm, m, k_out, hist, state, ws["tval"], cand_cap, counter,
                WIDTHS=sum(bits << (4 * i) for i, (_, bits) in enumerate(passes)), MP=next_pow2(m),
                BLOCK=block, SLACK=slack, FIRST=maxima is not None, **(common | {"num_warps": pass_warps}))
        else:
            for i, (shift, bits) in enumerate(passes[1:], start=1):
                radix_digit_pass_kernel[(rows, cdiv(m, pass_chunk))](
                    bm, m, k_out, hist, state, counter, ws["prog_eq"], SHIFT=shift, BITS=bits, PASS=i,
                    PREV_BITS=passes[i - 1][1], LAST=False, CHUNK=pass_chunk,
                    SKIP_IDLE=self._overrides.get("SKIP_IDLE", True), **common)
        if collect == "live":
            live = ws["live"].view(-1)[:rows * m]
            args = (flat, n, m, bm, live, hist, state, counter, ws["prog_eq"], ws["cand"], ws["tval"],
                    cand_cap)
            consts = dict(CHUNK=chunk, BLOCK=block, LAST_BITS=passes[-1][1], T_GIVEN=fused,
                          **(common | {"num_warps": collect_warps}))
            prefilter_collect_live_kernel[(rows, n_prog)](
                *args, LIVE_BLOCKS=live_blocks or self._live_blocks(rows * n_prog, args, consts), **consts)
        else:
            prefilter_collect_kernel[(rows, n_prog)](
                flat, n, hist, state, counter, ws["prog_eq"], ws["cand"], ws["tval"], cand_cap, CHUNK=chunk,
                LAST_BITS=passes[-1][1], T_GIVEN=fused, **(common | {"num_warps": collect_warps}))
        rank_block = rank[0]
        rank_progs = cdiv(cover * k_out, rank_block)
        tie_progs = 0 if ties_in_rank else n_prog
        prefilter_rank_kernel[(rows, rank_progs + tie_progs)](
            flat, n, k_out, hist, counter, ws["prog_eq"], ws["cand"], ws["tval"], vals, idx, cand_cap,
            out["entries"], out["width"], RANK_PROGS=rank_progs, RANK_BLOCK=rank_block, CMP_BLOCK=cmp_block,
            CHUNK=chunk, PP=next_pow2(n_prog), TIES_IN_RANK=ties_in_rank, LISTED=out["listed"],
            TIE_STEP=tie_step, **rank_load, **(common | {"num_warps": rank_warps}))


def batch_chunk(rows: int, n: int, programs: int = 1024) -> int:
    """Entries per program of a pass: 512, doubled up to 2048 while a pass would launch more than
    `programs` programs. Every program adds its histogram to its row's with atomics and pays the
    histogram's fixed cost, so many rows (a decode batch) run faster on larger chunks: H200 at 128K
    entries, k = 512 (docs/benchmarks.md, session 18): 8 rows 41.1 / 36.4 / 40.1 us for 512 / 1024 /
    2048, 64 rows 212.9 / 188.1 / 173.5 us, one row 15.0 / 14.5 / 18.1 us."""
    chunk = 512
    while chunk < 2048 and rows * cdiv(n, chunk) > programs:
        chunk *= 2
    return chunk


def rank_block_for(rows: int, k: int, programs: int = 2048) -> int:
    """Candidates per rank program (both forms' rank launches): 4, doubled while the launch would
    hold more than `programs` rank programs. H200, k = 512, us for 1 / 8 / 64 rows (session 27,
    docs/benchmarks.md): block-max form at 128K (live collect): blocks of 4 13.9 / 19.8 / 77.1, of
    16 14.6 / 21.4 / 58.8, of 64 18.7 / 23.8 / 58.8; radix form on a listed pool of 16K: 10.9 /
    15.9 / 47.5, 11.1 / 14.9 / 43.4, 14.2 / 18.4 / 46.7 (one row's 128 small programs run side by
    side; 64 rows' 8,192 queue in waves)."""
    block = 4
    while block < 64 and rows * cdiv(k, block) > programs:
        block *= 2
    return block


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's signature; a fresh launcher per call (hold a StableTopkLauncher to reuse
    its workspace)."""
    return StableTopkLauncher()(scores, k)
