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
    require,
)
from dsflash.plugins.pdl import pdl_launch_args, wait_for_earlier_grids


@triton.jit
def _listed_block_scores(q_ptr, w_ptr, k_ptr, entries_ptr, out_ptr, b, s, S, N, P, q, w, p,
                         I: tl.constexpr, J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr,
                         BLOCK_J: tl.constexpr, IEEE: tl.constexpr):
    """Scores of list slots p (one block) stored: -inf where the id is outside [0, N). The keys
    of such slots stay unread (masked lanes issue no memory requests)."""
    jj = tl.arange(0, BLOCK_J)
    pmask = p < P
    entry = tl.load(entries_ptr + (b * S + s) * P + p, mask=pmask, other=-1)
    listed = (entry >= 0) & (entry < N)
    keys = tl.load(k_ptr + (b * N + entry[:, None]) * J + jj[None, :],
                   mask=listed[:, None] & (jj < J)[None, :], other=0.0)
    acc = _row_key_scores(keys, q_ptr, w_ptr, b, s, S, q, w, I, J, BLOCK_N, BLOCK_I, BLOCK_J, IEEE)
    tl.store(out_ptr + (b * S + s) * P + p, tl.where(listed, acc, float("-inf")), mask=pmask)


@triton.jit
def csa2_index_score_pooled_kernel(q_ptr, w_ptr, k_ptr, entries_ptr, S, N, P, out_ptr,
                                   I: tl.constexpr, J: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, IEEE: tl.constexpr,
                                   BLOCKS: tl.constexpr = 1, STAGES: tl.constexpr = 1,
                                   PDL: tl.constexpr = False):
    # Grid (B * S, cdiv(P, BLOCK_N * BLOCKS)); BLOCKS > 1 runs a program's blocks in a software-
    # pipelined loop (the next blocks' ids and keys in flight while one is multiplied), as the mask
    # form's long-row launch does.
    wait_for_earlier_grids(PDL)
    b, s, q, w = _row_queries(q_ptr, w_ptr, S, I, J, BLOCK_I, BLOCK_J)
    first = tl.program_id(1) * BLOCKS * BLOCK_N
    for blk in tl.range(0, BLOCKS, num_stages=STAGES):
        p = first + blk * BLOCK_N + tl.arange(0, BLOCK_N)
        _listed_block_scores(q_ptr, w_ptr, k_ptr, entries_ptr, out_ptr, b, s, S, N, P, q, w, p, I, J,
                             BLOCK_N, BLOCK_I, BLOCK_J, IEEE)


def csa2_index_score_pooled(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, k_BNJ: torch.Tensor,
                            entries_BSP: torch.Tensor, *, overrides: dict | None = None) -> torch.Tensor:
    """The reference's signature (reference.py:csa2_index_score_pooled): entries [B, S, P] int32 or
    int64 ids, -1 (or any id outside [0, N)) for an empty slot. Launch settings as the mask form's
    for P entries a row (pipelined for long lists at a batch); `overrides` replaces them (BLOCK_N,
    BLOCKS, STAGES, num_warps, PDL: benchmarks, tests)."""
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
    out = torch.empty(b, s, p, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    over = dict(overrides or {})
    pdl = pdl_launch_args(q.device, {"PDL": over.pop("PDL", True)})
    cfg = launch_config(i, j, q.dtype) | listed_pipelined_config(b * s, p, j, q.dtype, q.device) | over
    grid = (b * s, cdiv(p, cfg["BLOCK_N"] * cfg.get("BLOCKS", 1)))
    csa2_index_score_pooled_kernel[grid](q, w, k, entries, s, n, p, out, I=i, J=j, **cfg, **pdl)
    return out


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
