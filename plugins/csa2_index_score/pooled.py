"""Csa2IndexScore over a listed candidate pool: scores of the entries a Reindex layer's pool lists
(reference.py:csa2_index_score_pooled), [B, S, P] for P listed ids per row, not [B, S, N].

The mask form (kernel.py) runs a program per block of N entries and skips the keys of invisible
entries, but a pool of 2,048 blocks of 8 groups scattered over 16K blocks leaves few 64-entry
blocks without a pooled entry, and the top-k after it still reads all N scores. Listed, the kernel
gathers only the P pooled keys (runs of 8 consecutive entries: 2 KB of bf16 keys at the released
sizes) and the top-k reads P scores. A launch-level path of the Triton OpSet, not a graph op
(graphs keep the mask form).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.csa2_index_score.kernel import (
    _check,
    _row_key_scores,
    _row_queries,
    launch_config,
    pipelined_config,
    pipelined_launch,
)
from dsflash.plugins.launch import (
    FLOATS,
    check_device,
    check_dtype,
    check_interpreter_dot,
    check_shape,
    is_pow2,
    require,
)
from dsflash.plugins.pdl import pdl_launch_args, wait_for_earlier_grids
from dsflash.plugins.stable_topk.keys import BIG


@triton.jit
def _listed_block_scores(q_ptr, w_ptr, k_ptr, entries_ptr, out_ptr, bm_ptr, b, s, S, N, P, q, w, start,
                         I: tl.constexpr, J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
                         BLOCK_J: tl.constexpr, IEEE: tl.constexpr, MAX_BLOCK: tl.constexpr):
    """Scores of list slots start + [0, BLOCK_N) (one block) stored: -inf where the id is outside
    [0, N). The keys of such slots stay unread (masked lanes issue no memory requests). MAX_BLOCK
    > 0: their maxima over runs of MAX_BLOCK slots too (store_block_maxima)."""
    jj = tl.arange(0, BLOCK_J)
    p = start + tl.arange(0, BLOCK_N)
    pmask = p < P
    entry = tl.load(entries_ptr + (b * S + s) * P + p, mask=pmask, other=-1)
    listed = (entry >= 0) & (entry < N)
    keys = tl.load(k_ptr + (b * N + entry[:, None]) * J + jj[None, :],
                   mask=listed[:, None] & (jj < J)[None, :], other=0.0)
    acc = _row_key_scores(keys, q_ptr, w_ptr, b, s, S, q, w, I, J, BLOCK_N, BLOCK_I, BLOCK_J, IEEE)
    score = tl.where(listed, acc, float("-inf"))
    tl.store(out_ptr + (b * S + s) * P + p, score, mask=pmask)
    store_block_maxima(score, bm_ptr, b * S + s, P, start, BLOCK_N, MAX_BLOCK)


@triton.jit
def store_block_maxima(score, bm_ptr, row, P, start, BLOCK_N: tl.constexpr, MAX_BLOCK: tl.constexpr):
    """The maxima of a block of BLOCK_N scores (slots start + [0, BLOCK_N) of a row of P; -inf
    past P) over runs of MAX_BLOCK slots, clamped as the top-k's keys clamp, into
    bm_ptr[row, start / MAX_BLOCK:] of a [rows, cdiv(P, MAX_BLOCK)] buffer: the block-max top-k's
    first launch (stable_topk/prefilter.py:block_max_pass_kernel) computes the same from the
    stored scores. Nothing where MAX_BLOCK is 0."""
    if MAX_BLOCK > 0:
        RUNS: tl.constexpr = BLOCK_N // MAX_BLOCK
        m = tl.cdiv(P, MAX_BLOCK)
        clamped = tl.minimum(tl.maximum(score, -BIG), BIG)
        top = tl.max(tl.reshape(clamped, (RUNS, MAX_BLOCK)), axis=1)
        j = start // MAX_BLOCK + tl.arange(0, RUNS)
        tl.store(bm_ptr + row.to(tl.int64) * m + j, top, mask=j < m)


@triton.jit
def csa2_index_score_pooled_kernel(q_ptr, w_ptr, k_ptr, entries_ptr, S, N, P, out_ptr, bm_ptr,
                                   I: tl.constexpr, J: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, IEEE: tl.constexpr,
                                   BLOCKS: tl.constexpr = 1, STAGES: tl.constexpr = 1,
                                   MAX_BLOCK: tl.constexpr = 0, PDL: tl.constexpr = False):
    # Grid (B * S, cdiv(P, BLOCK_N * BLOCKS)); BLOCKS > 1 runs a program's blocks in a software-
    # pipelined loop (the next blocks' ids and keys in flight while one is multiplied), as the mask
    # form's long-row launch does. MAX_BLOCK > 0: the block maxima into bm_ptr as well.
    wait_for_earlier_grids(PDL)
    b, s, q, w = _row_queries(q_ptr, w_ptr, S, I, J, BLOCK_I, BLOCK_J)
    first = tl.program_id(1) * BLOCKS * BLOCK_N
    for blk in tl.range(0, BLOCKS, num_stages=STAGES):
        _listed_block_scores(q_ptr, w_ptr, k_ptr, entries_ptr, out_ptr, bm_ptr, b, s, S, N, P, q, w,
                             first + blk * BLOCK_N, I, J, BLOCK_N, BLOCK_I, BLOCK_J, IEEE, MAX_BLOCK)


def csa2_index_score_pooled(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, k_BNJ: torch.Tensor,
                            entries_BSP: torch.Tensor, *, overrides: dict | None = None) -> torch.Tensor:
    """The reference's signature (reference.py:csa2_index_score_pooled): entries [B, S, P] int32 or
    int64 ids, -1 (or any id outside [0, N)) for an empty slot. Launch settings as the mask form's
    for P entries a row (pipelined for long lists at a batch); `overrides` replaces them (BLOCK_N,
    BLOCKS, STAGES, num_warps, PDL: benchmarks, tests)."""
    return _pooled_launch(q_BSIJ, w_BSI, k_BNJ, entries_BSP, 0, overrides)[0]


def csa2_index_score_pooled_maxima(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, k_BNJ: torch.Tensor,
                                   entries_BSP: torch.Tensor, block: int, *,
                                   overrides: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's signature (reference.py:csa2_index_score_pooled_maxima): the scores and
    their maxima over runs of `block` slots [B, S, cdiv(P, block)], written by the same launch
    (a power of two dividing its BLOCK_N; a ValueError naming it otherwise)."""
    return _pooled_launch(q_BSIJ, w_BSI, k_BNJ, entries_BSP, block, overrides)


def _pooled_launch(q_BSIJ, w_BSI, k_BNJ, entries_BSP, block: int, overrides: dict | None):
    """(scores, maxima or None) of the two launchers above (block 0: no maxima)."""
    op = "Csa2IndexScore(pooled)"
    check_shape(op, "q", q_BSIJ, (None, None, None, None))
    b, s, i, j = q_BSIJ.shape
    check_shape(op, "k", k_BNJ, (b, None, j))
    check_shape(op, "entries", entries_BSP, (b, s, None))
    p = entries_BSP.shape[2]
    _check(op, q_BSIJ, w_BSI, p)
    check_dtype(op, "k", k_BNJ, FLOATS)
    check_dtype(op, "entries", entries_BSP, (torch.int32, torch.int64))
    require(q_BSIJ.dtype == k_BNJ.dtype, f"{op}: q is {q_BSIJ.dtype} but k is {k_BNJ.dtype}")
    check_device(op, q=q_BSIJ, w=w_BSI, k=k_BNJ, entries=entries_BSP)
    check_interpreter_dot(op, q=q_BSIJ, k=k_BNJ)
    n = k_BNJ.shape[1]
    q, w, k, entries = (t.contiguous() for t in (q_BSIJ, w_BSI, k_BNJ, entries_BSP))
    over = dict(overrides or {})
    pdl = pdl_launch_args(q.device, {"PDL": over.pop("PDL", True)})
    cfg = launch_config(i, j, q.dtype) | listed_pipelined_config(b * s, p, j, q.dtype, q.device) | over
    out, maxima = scores_and_maxima(op, (b, s, p), block, cfg["BLOCK_N"], q.device)
    if out.numel() == 0:
        return out, maxima
    grid = (b * s, cdiv(p, cfg["BLOCK_N"] * cfg.get("BLOCKS", 1)))
    csa2_index_score_pooled_kernel[grid](q, w, k, entries, s, n, p, out, out if maxima is None else maxima,
                                         I=i, J=j, MAX_BLOCK=block, **cfg, **pdl)
    return out, maxima


def scores_and_maxima(op: str, shape_BSP: tuple, block: int, block_n: int, device: torch.device):
    """A listed index launch's outputs: the scores [B, S, P] fp32 and, for block > 0, their block
    maxima [B, S, cdiv(P, block)] (else None: the kernel then gets the scores' buffer in their
    place, never written through it). A ValueError names a block that is not a power of two
    dividing the launch's BLOCK_N (store_block_maxima's runs lie within one block)."""
    require(block == 0 or (is_pow2(block) and block_n % block == 0),
            f"{op}: maxima over runs of {block} slots: a power of two dividing the launch's BLOCK_N "
            f"{block_n} is needed")
    b, s, p = shape_BSP
    out = torch.empty(b, s, p, dtype=torch.float32, device=device)
    maxima = torch.empty(b, s, cdiv(p, block), dtype=torch.float32, device=device) if block else None
    return out, maxima


def listed_pipelined_config(rows: int, p: int, dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The mask form's pipelined settings (kernel.py:pipelined_config, where they apply) with the
    key copies two blocks ahead: 5 stages, runs of 8 blocks. Triton's pipeliner splits a loop's
    stages over the chain ids -> keys; at 3 (or 4) stages the next block's key copies are issued
    after a block's products and waited for first thing in the next block (TTGIR: async_wait num
    = 0), so a program's reads and products take turns, where at 5 they overlap (num = 1-2). The
    mask form has no such chain (its waits leave 5 groups in flight at 3 stages). H100, 2026-12-06
    (the candidate pool's 2,048 blocks of 8 of 128K per row, cold L2; bits equal to the default's):
    32 rows 55.7 us against 57.8, 64 rows 103.3 against 115.4 (5 stages in runs of 4: 57.2 / 103.7;
    6 stages in runs of 8: 55.5 / 103.5). The FP4 listed kernel (pooled_fp4.py) is slower at 5
    stages (57.1 against 54.1 us at 64 rows): its products, not its reads, set its time.

    Only where runs of 8 still leave pipelined_config's 1.5 programs per SM (from ~13 rows of
    16,384 slots on 132 SMs); fewer rows keep its settings (not measured with the deeper ones)."""
    cfg = pipelined_config(rows, p, dim, dtype, device)
    deep = listed_pipelined_launch()
    if not cfg or 2 * rows * cdiv(p, deep["BLOCKS"] * deep["BLOCK_N"]) < \
            3 * torch.cuda.get_device_properties(device).multi_processor_count:
        return cfg
    return deep


def listed_pipelined_launch() -> dict:
    """listed_pipelined_config's deeper settings: the pipelined launch's, 5 stages, runs of 8."""
    return pipelined_launch() | {"STAGES": 5, "BLOCKS": 8}
