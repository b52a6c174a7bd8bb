"""Csa2IndexScore over a listed candidate pool with the release's FP4 index keys
(reference.py:csa2_index_score_fp4_pooled): pooled.py's listed form over fp4_mma.py's keys, 68 B
per 128-dim entry instead of 256.

A Reindex layer over its listed pool reads each listed entry's id, its key and writes its score:
264 B per entry with bf16 keys, 76 B with FP4 keys. At a decode batch that index kernel is the
layer's largest part (64 rows x 16K listed entries: 82.7 us at 82% of its bf16 roofline on the
H200, 2026-12-04), so the FP4 keys bound it ~3.5x lower. The products are fp4_mma.py's: the keys
as e4m3 bytes on the FP8 tensor cores, the bf16 queries split in two e4m3 parts per head scale;
only the entry rows come from the list instead of a run of N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.csa2_index_score.fp4_mma import _fp4_block_dots, _weighted_relu_sum, program_queries
from dsflash.plugins.csa2_index_score.kernel import _check, check_fp4_keys, exponent_words
from dsflash.plugins.csa2_index_score.pooled import scores_and_maxima, store_block_maxima
from dsflash.plugins.launch import (
    check_device,
    check_dtype,
    check_shape,
    interpreting,
    next_pow2,
    require,
)
from dsflash.plugins.pdl import pdl_launch_args, wait_for_earlier_grids


@triton.jit
def _listed_fp4_scores(codes_ptr, exps_ptr, entries_ptr, out_ptr, bm_ptr, row, b, N, P, start, q_hi, q_lo, w,
                       I: tl.constexpr, J: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
                       EXP_WORDS: tl.constexpr, SKIP_EMPTY: tl.constexpr, LO: tl.constexpr,
                       MAX_BLOCK: tl.constexpr):
    """Scores of list slots start + [0, BLOCK_N) (one block) stored, -inf where the id is outside
    [0, N); such slots' codes and exponents stay unread. SKIP_EMPTY: a block with no listed id (the
    list's -1 padding) does no products at all (a branch; the unpipelined launch). MAX_BLOCK > 0:
    their maxima over runs of MAX_BLOCK slots too (pooled.py:store_block_maxima)."""
    p = start + tl.arange(0, BLOCK_N)
    pmask = p < P
    entry = tl.load(entries_ptr + row * P + p, mask=pmask, other=-1)
    listed = (entry >= 0) & (entry < N)
    score = tl.zeros([BLOCK_N], dtype=tl.float32)
    if SKIP_EMPTY:
        if tl.max(listed.to(tl.int32), axis=0) > 0:
            acc = _fp4_block_dots(codes_ptr, exps_ptr, b * N + entry, listed, q_hi, q_lo, I, J, BLOCK_N, ASM,
                                  EXP_WORDS, LO)
            score = _weighted_relu_sum(acc, w)
    else:
        acc = _fp4_block_dots(codes_ptr, exps_ptr, b * N + entry, listed, q_hi, q_lo, I, J, BLOCK_N, ASM,
                              EXP_WORDS, LO)
        score = _weighted_relu_sum(acc, w)
    score = tl.where(listed, score, float("-inf"))
    tl.store(out_ptr + row * P + p, score, mask=pmask)
    store_block_maxima(score, bm_ptr, row, P, start, BLOCK_N, MAX_BLOCK)


@triton.jit
def csa2_index_score_fp4_pooled_kernel(q_ptr, w_ptr, codes_ptr, exps_ptr, entries_ptr, S, N, P, out_ptr,
                                       bm_ptr, I: tl.constexpr, J: tl.constexpr, JP: tl.constexpr,
                                       BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, ASM: tl.constexpr,
                                       STAGES: tl.constexpr = 0, EXP_WORDS: tl.constexpr = False,
                                       LO_SKIP: tl.constexpr = True, MAX_BLOCK: tl.constexpr = 0,
                                       PDL: tl.constexpr = False):
    """Grid (B * S query rows, runs of BLOCKS list blocks of BLOCK_N slots): one query split per
    program serves its blocks. STAGES 0: plain loop, empty blocks skipped; STAGES >= 2: a
    software-pipelined loop (the next blocks' ids, codes and exponents in flight while one is
    multiplied), as fp4_mma.py's batch launch. LO_SKIP (default): a row whose query split has no lo
    part (kv_qat's queries, as the model makes them) runs a copy of the loop without the lo
    products (H200, 2026-12-06, kv_qat queries, 16K listed entries per row: 68.4 against 71.9 us at
    64 rows, 21.9 against 23.1 at 8; 129-132 registers per thread either way, so 3 programs per SM:
    the offline sm_90 compile of session 38 with int32 ids and word exponents). Measured and dropped
    (session 36): the run's ids loaded before the loop, each block's taken out in registers, so
    that no code copy waits on the newest id copy (the TTGIR's async_wait of 0): 86.6 against
    65.0 us at 64 rows (H100), a cross-warp reduction per block costing more than it hid.
    MAX_BLOCK > 0: the block maxima into bm_ptr as well (csa2_index_score_fp4_pooled_maxima)."""
    wait_for_earlier_grids(PDL)
    row, b, q_hi, q_lo, w, has_lo = program_queries(q_ptr, w_ptr, S, I, J, JP)
    first = tl.program_id(1) * BLOCKS
    last = tl.minimum(first + BLOCKS, tl.cdiv(P, BLOCK_N))
    if LO_SKIP:  # a row without a lo part (kv_qat's queries) runs the loop without the lo products
        if has_lo:
            _listed_blocks(codes_ptr, exps_ptr, entries_ptr, out_ptr, bm_ptr, row, b, N, P, first, last, q_hi,
                           q_lo, w, I, J, BLOCK_N, ASM, STAGES, EXP_WORDS, True, MAX_BLOCK)
        else:
            _listed_blocks(codes_ptr, exps_ptr, entries_ptr, out_ptr, bm_ptr, row, b, N, P, first, last, q_hi,
                           q_lo, w, I, J, BLOCK_N, ASM, STAGES, EXP_WORDS, False, MAX_BLOCK)
    else:
        _listed_blocks(codes_ptr, exps_ptr, entries_ptr, out_ptr, bm_ptr, row, b, N, P, first, last, q_hi,
                       q_lo, w, I, J, BLOCK_N, ASM, STAGES, EXP_WORDS, True, MAX_BLOCK)


@triton.jit
def _listed_blocks(codes_ptr, exps_ptr, entries_ptr, out_ptr, bm_ptr, row, b, N, P, first, last, q_hi, q_lo,
                   w, I: tl.constexpr, J: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr,
                   STAGES: tl.constexpr, EXP_WORDS: tl.constexpr, LO: tl.constexpr, MAX_BLOCK: tl.constexpr):
    """List blocks [first, last) of one query row (the kernel's loop; LO: with the lo products)."""
    if STAGES == 0:
        for blk in range(first, last):
            _listed_fp4_scores(codes_ptr, exps_ptr, entries_ptr, out_ptr, bm_ptr, row, b, N, P, blk * BLOCK_N,
                               q_hi, q_lo, w, I, J, BLOCK_N, ASM, EXP_WORDS, True, LO, MAX_BLOCK)
    else:
        for blk in tl.range(first, last, num_stages=STAGES):
            _listed_fp4_scores(codes_ptr, exps_ptr, entries_ptr, out_ptr, bm_ptr, row, b, N, P, blk * BLOCK_N,
                               q_hi, q_lo, w, I, J, BLOCK_N, ASM, EXP_WORDS, False, LO, MAX_BLOCK)


def csa2_index_score_fp4_pooled(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, codes_BNH: torch.Tensor,
                                exps_BNG: torch.Tensor, entries_BSP: torch.Tensor, *,
                                overrides: dict | None = None) -> torch.Tensor:
    """The reference's signature (reference.py:csa2_index_score_fp4_pooled): FP4 keys as codes
    [B, N, J/2] uint8 and int8 exponents [B, N, J/32] (model/quant.py:fp4_pow2_pack), entries
    [B, S, P] int32/int64 ids, -1 (or any id outside [0, N)) for an empty slot. The FP8
    tensor-core products need bf16 queries (fp32 under the Triton interpreter, which cannot
    multiply bf16) and a power-of-two head count of 16 or more. Launch settings from
    pooled_fp4_config; `overrides` replaces them (BLOCK_N, BLOCKS, STAGES, EXP_WORDS, LO_SKIP,
    num_warps, maxnreg, PDL: benchmarks, tests)."""
    return _fp4_pooled_launch(q_BSIJ, w_BSI, codes_BNH, exps_BNG, entries_BSP, 0, overrides)[0]


def csa2_index_score_fp4_pooled_maxima(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, codes_BNH: torch.Tensor,
                                       exps_BNG: torch.Tensor, entries_BSP: torch.Tensor, block: int, *,
                                       overrides: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's signature (reference.py:csa2_index_score_fp4_pooled_maxima): the scores and
    their maxima over runs of `block` slots [B, S, cdiv(P, block)] from the same launch (a power of
    two dividing its BLOCK_N; a ValueError naming it otherwise)."""
    return _fp4_pooled_launch(q_BSIJ, w_BSI, codes_BNH, exps_BNG, entries_BSP, block, overrides)


def _fp4_pooled_launch(q_BSIJ, w_BSI, codes_BNH, exps_BNG, entries_BSP, block: int, overrides: dict | None):
    """(scores, maxima or None) of the two launchers above (block 0: no maxima)."""
    op = "Csa2IndexScore(fp4, pooled)"
    n, p = _check_listed(op, q_BSIJ, w_BSI, codes_BNH, exps_BNG, entries_BSP)
    b, s, heads, j = q_BSIJ.shape
    check_dtype(op, "q", q_BSIJ, (torch.float32 if interpreting() else torch.bfloat16,))
    require(heads >= 16 and heads == next_pow2(heads),
            f"{op}: the FP8 tensor-core path needs a power-of-two head count >= 16, got {heads}")
    check_device(op, q=q_BSIJ, w=w_BSI, codes=codes_BNH, exps=exps_BNG, entries=entries_BSP)
    q, w, entries = q_BSIJ.contiguous(), w_BSI.contiguous(), entries_BSP.contiguous()
    over = dict(overrides or {})
    pdl = pdl_launch_args(q.device, {"PDL": over.pop("PDL", True)})
    cfg = pooled_fp4_config(b * s, p, q.device) | over
    out, maxima = scores_and_maxima(op, (b, s, p), block, cfg["BLOCK_N"], q.device)
    if out.numel() == 0:
        return out, maxima
    exps = exponent_words(op, exps_BNG, j, cfg)
    grid = (b * s, cdiv(cdiv(p, cfg["BLOCK_N"]), cfg["BLOCKS"]))
    csa2_index_score_fp4_pooled_kernel[grid](q, w, codes_BNH.contiguous(), exps, entries, s, n, p, out,
                                             out if maxima is None else maxima, I=heads, J=j, JP=next_pow2(j),
                                             ASM=not interpreting(), MAX_BLOCK=block, **cfg, **pdl)
    return out, maxima


def _check_listed(op: str, q_BSIJ, w_BSI, codes_BNH, exps_BNG, entries_BSP) -> tuple[int, int]:
    """The listed pool's inputs, as both paths below take them: FP4 keys (check_fp4_keys), ids
    [B, S, P] int32/int64 and the queries' head weights. Returns (N, P)."""
    n = check_fp4_keys(op, q_BSIJ, codes_BNH, exps_BNG)
    b, s = q_BSIJ.shape[:2]
    check_shape(op, "entries", entries_BSP, (b, s, None))
    p = entries_BSP.shape[2]
    _check(op, q_BSIJ, w_BSI, p)
    check_dtype(op, "entries", entries_BSP, (torch.int32, torch.int64))
    return n, p


def listed_fp4_scores(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, codes_BNH: torch.Tensor,
                      exps_BNG: torch.Tensor, entries_BSP: torch.Tensor) -> torch.Tensor:
    """What OpSet("triton") runs for a listed pool over FP4 keys, with the reference's signature:
    the kernel above where its FP8 products fit (bf16 queries, fp32 under the Triton interpreter; a
    power-of-two head count >= 16: the released sizes). Otherwise (test and small presets) the
    listed entries' codes and exponents are gathered, decoded exactly
    (reference.py:unpack_keys_fp4) and scored with PyTorch ops: work in proportion to the list,
    not to N."""
    return _listed_fp4(q_BSIJ, w_BSI, codes_BNH, exps_BNG, entries_BSP, 0)[0]


def listed_fp4_scores_maxima(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, codes_BNH: torch.Tensor,
                             exps_BNG: torch.Tensor, entries_BSP: torch.Tensor,
                             block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """listed_fp4_scores with the scores' block maxima (reference.py:
    csa2_index_score_fp4_pooled_maxima's signature): from the kernel's launch where it runs, else
    from the scores (stable_topk/reference.py:block_maxima)."""
    return _listed_fp4(q_BSIJ, w_BSI, codes_BNH, exps_BNG, entries_BSP, block)


def _listed_fp4(q_BSIJ, w_BSI, codes_BNH, exps_BNG, entries_BSP, block: int):
    """(scores, maxima or None) of the two functions above (block 0: no maxima)."""
    heads = q_BSIJ.shape[2] if q_BSIJ.dim() == 4 else 0
    dtype = torch.float32 if interpreting() else torch.bfloat16
    if heads >= 16 and heads == next_pow2(heads) and q_BSIJ.dtype == dtype:
        return _fp4_pooled_launch(q_BSIJ, w_BSI, codes_BNH, exps_BNG, entries_BSP, block, None)
    from dsflash.plugins.csa2_index_score.reference import csa2_index_score, unpack_keys_fp4
    from dsflash.plugins.stable_topk.reference import block_maxima

    n, p = _check_listed("Csa2IndexScore(fp4, pooled)", q_BSIJ, w_BSI, codes_BNH, exps_BNG, entries_BSP)
    b, s, heads, j = q_BSIJ.shape
    ids = entries_BSP.long()
    listed = (ids >= 0) & (ids < n)
    if n == 0:
        scores = torch.full(ids.shape, float("-inf"), dtype=torch.float32, device=ids.device)
    else:
        rows = ids.clamp(0, n - 1).flatten(1).unsqueeze(-1)  # [B, S*P, 1]
        codes = codes_BNH.gather(1, rows.expand(-1, -1, codes_BNH.shape[2]))
        exps = exps_BNG.gather(1, rows.expand(-1, -1, exps_BNG.shape[2]))
        keys = unpack_keys_fp4(codes, exps, torch.float32).view(b * s, p, j)
        # each query row against its own listed keys: the reference with one row per batch item
        scores = csa2_index_score(q_BSIJ.reshape(b * s, 1, heads, j), w_BSI.reshape(b * s, 1, heads), keys,
                                  listed.view(b * s, 1, p)).view(b, s, p)
    return scores, (block_maxima(scores, block) if block else None)


# A wave of the pipelined launch (4 programs on each SM) in runs of 4, 8 and 16 blocks, relative
# to runs of 4: H100 sweep under the register cap (16,384 slots a row, 2026-12-06), full waves
# of 4 ~16.5 us, 8 ~29, 16 ~53; longer runs do more work per us but fill fewer waves.
_WAVE_COST = {4: 1.0, 8: 1.76, 16: 3.2}
# a part-filled last wave costs this much of a full one, plus the rest in proportion to its fill
# (same sweep: runs of 16 at 0.36 / 0.48 / 0.73 / 0.97 of a wave took 0.57 / 0.64 / 0.83 / 1.0
# of a full wave's time: the fewer programs share the memory bandwidth)
_TAIL_FLOOR = 0.35


def _wave_estimate(programs: int, slots: int, blocks: int) -> float:
    """Time of `programs` launched `slots` at once in runs of `blocks`, in full waves of runs of 4."""
    full, tail = divmod(programs, slots)
    return _WAVE_COST[blocks] * (full + (_TAIL_FLOOR + (1 - _TAIL_FLOOR) * tail / slots if tail else 0))


def pooled_fp4_config(rows: int, p: int, device: torch.device) -> dict:
    """Launch settings for `rows` lists of p slots. Under one program per SM with 4 blocks of 64
    slots each (one row): those, with the branch that skips empty blocks. Otherwise the pipelined
    loop over 128-slot blocks (3 stages, 4 warps), under a cap of 128 registers per thread, in the
    runs of 16, 8 or 4 blocks that _wave_estimate rates fastest (ties to the longer run).

    The cap (maxnreg): uncapped, the sm_90 compile (ptxas 12.8, offline, 32 heads x 128, one query
    row per batch item) takes 129 registers per thread with int32 ids, 133 with int64 ids and 167
    with byte exponents (EXP_WORDS off), so an SM holds 3 programs of 128 threads; at 128 it holds
    4, and the compile spills nothing (STACK 0) at runs of 4, 8 or 16. H100, 2026-12-06: never
    slower, 9-23% faster wherever over 3 programs per SM run (runs of 16 at 64 rows 55.1 us
    against 71.2). Caps that would fit 5 or 6 programs spill (96 registers: 104 B a thread, 80:
    more) and were slower at every run and row count swept (runs of 16 at 64 rows: 60.8 / 103.9
    us; docs/benchmarks.md, session 38).

    The runs: a wave is 4 programs per SM; a run of n blocks is one program, so longer runs make
    fewer programs, each doing more. H100 sweep under the cap (bench_layer_batch.py --fp4-configs,
    16,384 slots a row, 2026-12-06; every config's scores equal to the default's), us for runs of
    4 / 8 / 16: 8 rows 11.5 / 14.7 / 22.0; 16 rows 17.3 / 17.8 / 24.6; 24 rows 28.5 / 23.5 / 30.2;
    32 rows 34.4 / 31.1 / 33.7; 48 rows 49.5 / 52.3 / 44.2; 64 rows 63.8 / 58.4 / 55.3; 96 rows
    91.5 / 84.1 / 95.6; 128 rows 118.9 / 109.7 / 104.4. The estimate picks the fastest at each.
    The earlier rule (the longest run leaving 4 programs per SM) lost 3-12 us at 32, 48, 64 and
    96 rows (docs/benchmarks.md, session 38)."""
    branch = {"BLOCK_N": 64, "BLOCKS": 4, "STAGES": 0, "num_warps": 4}
    if device.type != "cuda":
        return branch
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if rows * cdiv(p, branch["BLOCK_N"] * branch["BLOCKS"]) < sms:
        return branch
    blocks = min((16, 8, 4), key=lambda n: _wave_estimate(rows * cdiv(p, 128 * n), 4 * sms, n))
    return {"BLOCK_N": 128, "BLOCKS": blocks, "STAGES": 3, "num_warps": 4, "maxnreg": 128}
