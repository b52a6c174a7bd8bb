"""Csa2IndexScore as a Triton kernel: I[b,s,n] = sum_i w[b,s,i] relu(q[b,s,i,:] . k[b,n,:]),
-inf where entry n is not visible.

Grid: (B * S query rows, entry blocks of BLOCK_N). Each program loads one block of index keys
[BLOCK_N, J] once and multiplies it by the row's heads BLOCK_I at a time on the tensor cores
(fp32 accumulate; fp32 inputs use exact IEEE products, not tf32). A block with no visible entry
(a Reindex layer's candidate pool leaves most blocks out) skips the key load and the products:
the kernel then reads only the pooled keys, which is what makes hierarchical selection cheap.
For long rows the JIT launch gives each program several blocks in a software-pipelined loop
(pipelined_config), the next blocks' keys loading while one is multiplied.

`csa2_index_score_fp4` reads the keys as the release stores them (FP4 e2m1 codes with one
power-of-two scale per 32 channels, model/quant.py:fp4_pow2_pack; 68 B per 128-dim entry, not
256) and decodes them in registers, exactly; a launch-level variant, not a graph op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.launch import (
    FLOATS,
    HALF_FLOATS,
    check_device,
    check_dtype,
    check_interpreter_dot,
    check_shape,
    interpreting,
    next_pow2,
    require,
)
from dsflash.plugins.pdl import pdl_launch_args, wait_for_earlier_grids


@triton.jit
def _head_group(q_ptr, w_ptr, b, s, S, i0, I: tl.constexpr, J: tl.constexpr, BLOCK_I: tl.constexpr,
                BLOCK_J: tl.constexpr):
    """Queries [BLOCK_I, BLOCK_J] and weights [BLOCK_I] (fp32) of heads i0 .. i0 + BLOCK_I."""
    jj = tl.arange(0, BLOCK_J)
    ii = i0 + tl.arange(0, BLOCK_I)
    imask = ii < I
    q = tl.load(q_ptr + ((b * S + s) * I + ii[:, None]) * J + jj[None, :],
                mask=imask[:, None] & (jj < J)[None, :], other=0.0)
    w = tl.load(w_ptr + (b * S + s) * I + ii, mask=imask, other=0.0).to(tl.float32)
    return q, w


@triton.jit
def _group_scores(keys, q, w, IEEE: tl.constexpr):
    """sum over one head group of w[i] relu(keys . q[i]): [BLOCK_N] in fp32, on the tensor cores."""
    if IEEE:
        dots = tl.dot(keys, tl.trans(q), input_precision="ieee")
    else:
        dots = tl.dot(keys, tl.trans(q))
    return tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)


@triton.jit
def _block_scores(keys, q_ptr, w_ptr, b, s, S, I: tl.constexpr, J: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, IEEE: tl.constexpr):
    """sum_i w[i] relu(keys . q[i]) for one block of keys [BLOCK_N, BLOCK_J], BLOCK_I heads at a
    time."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i0 in tl.static_range(0, I, BLOCK_I):
        q, w = _head_group(q_ptr, w_ptr, b, s, S, i0, I, J, BLOCK_I, BLOCK_J)
        acc += _group_scores(keys, q, w, IEEE)
    return acc


@triton.jit
def _entry_block(vis_ptr, S, N, BLOCK_N: tl.constexpr):
    """Grid (B * S query rows, entry blocks): this program's batch, row, entries, their mask and
    visibility."""
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s = row % S
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    return b, s, n, nmask, tl.load(vis_ptr + (b * S + s) * N + n, mask=nmask, other=0) != 0


@triton.jit
def csa2_index_score_kernel(q_ptr, w_ptr, k_ptr, vis_ptr, S, N, out_ptr,
                            I: tl.constexpr, J: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, IEEE: tl.constexpr,
                            BLOCKS: tl.constexpr = 1, STAGES: tl.constexpr = 1, PDL: tl.constexpr = False):
    # TensorRT's AOT order (inputs, integer scalars, outputs); contiguous tensors, so strides
    # follow from the sizes. Grid (B * S, cdiv(N, BLOCK_N * BLOCKS)).
    wait_for_earlier_grids(PDL)
    if BLOCKS == 1:  # one block: skipped whole (keys unread, no products) when none is visible
        b, s, n, nmask, vis = _entry_block(vis_ptr, S, N, BLOCK_N)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        if tl.max(vis.to(tl.int32), axis=0) > 0:
            jj = tl.arange(0, BLOCK_J)
            keys = tl.load(k_ptr + (b * N + n[:, None]) * J + jj[None, :],
                           mask=nmask[:, None] & (jj < J)[None, :], other=0.0)
            acc = _block_scores(keys, q_ptr, w_ptr, b, s, S, I, J, BLOCK_N, BLOCK_I, BLOCK_J, IEEE)
        tl.store(out_ptr + (b * S + s) * N + n, tl.where(vis, acc, float("-inf")), mask=nmask)
    else:
        # BLOCKS consecutive blocks in a software-pipelined loop: the loads of the next STAGES - 1
        # blocks are in flight while one block is multiplied, which a one-block program cannot
        # do (it loads, then waits, then computes).
        b, s, q, w = _row_queries(q_ptr, w_ptr, S, I, J, BLOCK_I, BLOCK_J)
        first = tl.program_id(1) * BLOCKS * BLOCK_N
        for blk in tl.range(0, BLOCKS, num_stages=STAGES):
            n = first + blk * BLOCK_N + tl.arange(0, BLOCK_N)
            _stored_block_scores(q_ptr, w_ptr, k_ptr, vis_ptr, out_ptr, b, s, S, N, q, w, n, I, J, BLOCK_N,
                                 BLOCK_I, BLOCK_J, IEEE)


@triton.jit
def _row_queries(q_ptr, w_ptr, S, I: tl.constexpr, J: tl.constexpr, BLOCK_I: tl.constexpr,
                 BLOCK_J: tl.constexpr):
    """Grid (B * S query rows, ...): the row's batch and position, and with one head group (the
    release: 32 heads) its queries and weights, loaded once for all of a program's blocks
    (0.0 placeholders otherwise: each block then loads its head groups)."""
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s = row % S
    if I <= BLOCK_I:
        q, w = _head_group(q_ptr, w_ptr, b, s, S, 0, I, J, BLOCK_I, BLOCK_J)
    else:
        q, w = 0.0, 0.0
    return b, s, q, w


@triton.jit
def _row_key_scores(keys, q_ptr, w_ptr, b, s, S, q, w, I: tl.constexpr, J: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, IEEE: tl.constexpr):
    """Scores of a key tile for row (b, s): with the row's one head group already loaded
    (_row_queries: q, w), or loading its head groups one at a time."""
    if I <= BLOCK_I:
        acc = _group_scores(keys, q, w, IEEE)
    else:
        acc = _block_scores(keys, q_ptr, w_ptr, b, s, S, I, J, BLOCK_N, BLOCK_I, BLOCK_J, IEEE)
    return acc


@triton.jit
def _stored_block_scores(q_ptr, w_ptr, k_ptr, vis_ptr, out_ptr, b, s, S, N, q, w, n, I: tl.constexpr,
                         J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
                         IEEE: tl.constexpr):
    """Scores of entries n (one block) stored: -inf where not visible. Keys of entries not
    visible stay unread (masked lanes issue no memory requests), so a Reindex layer reads only
    its pool."""
    jj = tl.arange(0, BLOCK_J)
    nmask = n < N
    vis = tl.load(vis_ptr + (b * S + s) * N + n, mask=nmask, other=0) != 0
    keys = tl.load(k_ptr + (b * N + n[:, None]) * J + jj[None, :],
                   mask=(nmask & vis)[:, None] & (jj < J)[None, :], other=0.0)
    acc = _row_key_scores(keys, q_ptr, w_ptr, b, s, S, q, w, I, J, BLOCK_N, BLOCK_I, BLOCK_J, IEEE)
    tl.store(out_ptr + (b * S + s) * N + n, tl.where(vis, acc, float("-inf")), mask=nmask)


@triton.jit
def e2m1_nibble_values(nib):
    """FP4 e2m1 nibbles (bit 3 = sign) -> grid values 0, .5, 1, 1.5, 2, 3, 4, 6 in fp32."""
    code = nib & 7
    half = (code & 1).to(tl.float32) * 0.5
    pow2 = (1 << tl.maximum((code >> 1) - 1, 0)).to(tl.float32)
    mag = tl.where((code >> 1) == 0, half, (1.0 + half) * pow2)
    return tl.where((nib & 8) != 0, -mag, mag)


@triton.jit
def exact_pow2(e):
    """2^e in fp32 for every int8 e, exactly: the product of two normal powers of two,
    2^(e >> 1) and 2^(e - (e >> 1)), both exponents in [-64, 64]; exponents below -126 (never
    written by the packer) give the exact subnormals. Five integer/float operations, no min/max."""
    half = e >> 1
    first = ((half + 127) << 23).to(tl.float32, bitcast=True)
    return first * ((e - half + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_keys(codes_ptr, exps_ptr, entry, nmask, J: tl.constexpr, BLOCK_N: tl.constexpr,
              GP: tl.constexpr, dtype):
    """Keys [BLOCK_N, GP * 32] in dtype, exact (grid value x 2^e): the codes as [BLOCK_N, GP, 16]
    bytes (each scale group's 16 bytes one contiguous load), each group's exponent broadcast
    over its bytes, the low (even channel) and high (odd channel) nibbles interleaved back by a
    join and a reshape."""
    G: tl.constexpr = J // 32
    g = tl.arange(0, GP)
    hb = tl.arange(0, 16)
    gm = nmask[:, None] & (g < G)[None, :]
    byte = tl.load(codes_ptr + entry[:, None, None] * (J // 2) + g[None, :, None] * 16 + hb[None, None, :],
                   mask=gm[:, :, None], other=0).to(tl.int32)
    e = tl.load(exps_ptr + entry[:, None] * G + g[None, :], mask=gm, other=0).to(tl.int32)
    scale = exact_pow2(e)[:, :, None]
    even = e2m1_nibble_values(byte & 15) * scale
    odd = e2m1_nibble_values(byte >> 4) * scale
    return tl.reshape(tl.join(even, odd), [BLOCK_N, GP * 32]).to(dtype)


@triton.jit
def csa2_index_score_fp4_kernel(q_ptr, w_ptr, codes_ptr, exps_ptr, vis_ptr, S, N, out_ptr,
                                I: tl.constexpr, J: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, IEEE: tl.constexpr,
                                PDL: tl.constexpr = False):
    """The same scores with the keys read as stored in the release: 68 B per 128-dim entry
    (64 B of codes, 4 exponents) instead of 256, decoded in registers into the bf16 kernel's
    key tile. H200, 128K entries (docs/benchmarks.md): 25.9 us, 9% of its roofline and still
    2.7x the bf16 kernel's 9.7 us; kv_qat models, which keep their keys so (model/cache.py), use
    it where the FP8 path does not fit (few heads, short rows). Measured and dropped: one
    byte and one exponent gather per channel (49 us), 16-channel dots per scale group and
    nibble (55 us), even/odd channel halves with two dots (35-101 us over block sizes), bf16 keys
    built as bit patterns from integer ops alone (25.0 us: the decode arithmetic is not what
    limits it)."""
    wait_for_earlier_grids(PDL)
    b, s, n, nmask, vis = _entry_block(vis_ptr, S, N, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if tl.max(vis.to(tl.int32), axis=0) > 0:
        keys = _fp4_keys(codes_ptr, exps_ptr, b * N + n, nmask, J, BLOCK_N, BLOCK_J // 32,
                         q_ptr.dtype.element_ty)
        acc = _block_scores(keys, q_ptr, w_ptr, b, s, S, I, J, BLOCK_N, BLOCK_I, BLOCK_J, IEEE)
    tl.store(out_ptr + (b * S + s) * N + n, tl.where(vis, acc, float("-inf")), mask=nmask)


def _check(op, q_BSIJ, w_BSI, n, visible_BSN=None):
    """The queries, weights and (mask form) the visibility [B, S, n]."""
    check_shape(op, "q", q_BSIJ, (None, None, None, None))
    b, s, i, j = q_BSIJ.shape
    check_shape(op, "w", w_BSI, (b, s, i))
    for name, t in (("q", q_BSIJ), ("w", w_BSI)):
        check_dtype(op, name, t, FLOATS)
    if visible_BSN is not None:
        check_shape(op, "visible", visible_BSN, (b, s, n))
        check_dtype(op, "visible", visible_BSN, (torch.bool,))
    require(j <= 256, f"{op}: index_head_dim {j} > 256, the largest the kernel keeps in registers")


def _launch(kernel, q_BSIJ, w_BSI, keys: tuple, n: int, visible_BSN, overrides: dict | None = None):
    b, s, i, j = q_BSIJ.shape
    q, w, vis = q_BSIJ.contiguous(), w_BSI.contiguous(), visible_BSN.contiguous().view(torch.uint8)
    out = torch.empty(b, s, n, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    over = dict(overrides or {})
    pdl = pdl_launch_args(q.device, {"PDL": over.pop("PDL", True)})
    cfg = launch_config(i, j, q.dtype)
    if kernel is csa2_index_score_kernel:
        cfg |= pipelined_config(b * s, n, j, q.dtype, q.device)
    cfg |= over
    grid = (b * s, cdiv(n, cfg["BLOCK_N"] * cfg.get("BLOCKS", 1)))
    kernel[grid](q, w, *(k.contiguous() for k in keys), vis, s, n, out, I=i, J=j, **cfg, **pdl)
    return out


def csa2_index_score(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, k_BNJ: torch.Tensor,
                     visible_BSN: torch.Tensor, *, overrides: dict | None = None) -> torch.Tensor:
    """The reference's signature; `overrides` replaces launch parameters (BLOCK_N, BLOCKS, STAGES,
    num_warps, PDL: benchmarks, tests)."""
    op = "Csa2IndexScore"
    check_shape(op, "q", q_BSIJ, (None, None, None, None))
    b, _, _, j = q_BSIJ.shape
    check_shape(op, "k", k_BNJ, (b, None, j))
    _check(op, q_BSIJ, w_BSI, k_BNJ.shape[1], visible_BSN)
    check_dtype(op, "k", k_BNJ, FLOATS)
    require(q_BSIJ.dtype == k_BNJ.dtype, f"{op}: q is {q_BSIJ.dtype} but k is {k_BNJ.dtype}")
    check_device(op, q=q_BSIJ, w=w_BSI, k=k_BNJ, visible=visible_BSN)
    check_interpreter_dot(op, q=q_BSIJ, k=k_BNJ)
    return _launch(csa2_index_score_kernel, q_BSIJ, w_BSI, (k_BNJ,), k_BNJ.shape[1], visible_BSN, overrides)


def csa2_index_score_fp4(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, codes_BNH: torch.Tensor,
                         exps_BNG: torch.Tensor, visible_BSN: torch.Tensor, *,
                         overrides: dict | None = None) -> torch.Tensor:
    """The reference's (reference.py:csa2_index_score_fp4) signature: keys as FP4 codes [B, N, J/2]
    (uint8) with one int8 exponent per 32 channels [B, N, J/32] (model/quant.py:fp4_pow2_pack).
    From 32K entries over all query rows, bf16 queries with a power-of-two head count of 16 or more
    run on the FP8 tensor cores (fp4_mma.py); other calls use the exact bf16/fp32 decode above.
    `overrides` replaces launch parameters (PATH "mma" or "decode", BLOCK_N, BLOCKS, STAGES,
    EXP_WORDS, LO_SKIP (fp4_mma.py), num_warps, maxnreg: benchmark sweeps, tests)."""
    op = "Csa2IndexScore(fp4)"
    n = check_fp4_keys(op, q_BSIJ, codes_BNH, exps_BNG)
    b, _, _, j = q_BSIJ.shape
    _check(op, q_BSIJ, w_BSI, n, visible_BSN)
    check_dtype(op, "q", q_BSIJ, (torch.bfloat16, torch.float16, torch.float32))
    check_device(op, q=q_BSIJ, w=w_BSI, codes=codes_BNH, exps=exps_BNG, visible=visible_BSN)
    check_interpreter_dot(op, q=q_BSIJ)
    over = dict(overrides or {})
    heads = q_BSIJ.shape[2]
    mma_fits = heads >= 16 and heads == next_pow2(heads)
    # H200, 2026-12-04 (docs/benchmarks.md): one row, the FP8 path against the decode 6.4 / 2.6 us at
    # 4K entries, 6.3 / 4.1 at 16K, 6.3 / 7.2 at 32K, 7.1 / 13.2 at 64K, 9.2 / 25.2 at 128K (the
    # FP8 path's ~6 us floor is a program's query split and its serial blocks); at 16K entries a
    # row, 8 rows 11.0 / 25.5 us and 64 rows 56.3 / 189.4: the FP8 path from 32K entries in all
    wide = b * q_BSIJ.shape[1] * n >= 32768 and mma_fits and q_BSIJ.dtype == torch.bfloat16
    path = over.pop("PATH", "mma" if wide else "decode")
    require(path in ("mma", "decode"), f"{op}: PATH {path!r} is not one of 'mma', 'decode'")
    if path == "decode":
        return _launch(csa2_index_score_fp4_kernel, q_BSIJ, w_BSI, (codes_BNH, exps_BNG), n, visible_BSN,
                       over)
    require(mma_fits, f"{op}: the FP8 tensor-core path needs a power-of-two head count >= 16, got {heads}")
    from dsflash.plugins.csa2_index_score.fp4_mma import csa2_index_score_fp4_mma_kernel

    q, w, vis = q_BSIJ.contiguous(), w_BSI.contiguous(), visible_BSN.contiguous().view(torch.uint8)
    out = torch.empty(b, q.shape[1], n, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    pdl = pdl_launch_args(q.device, {"PDL": over.pop("PDL", True)})
    cfg = fp4_mma_config(b * q.shape[1], n, q.device) | over
    exps = exponent_words(op, exps_BNG, j, cfg)
    grid = (b * q.shape[1], cdiv(cdiv(n, cfg["BLOCK_N"]), cfg["BLOCKS"]))
    csa2_index_score_fp4_mma_kernel[grid](q, w, codes_BNH.contiguous(), exps, vis, q.shape[1], n, out,
                                          I=heads, J=j, JP=next_pow2(j), ASM=not interpreting(), **cfg,
                                          **pdl)
    return out


def check_fp4_keys(op: str, q_BSIJ: torch.Tensor, codes_BNH: torch.Tensor, exps_BNG: torch.Tensor) -> int:
    """FP4 keys as model/quant.py:fp4_pow2_pack stores them, for queries [B, S, I, J]: codes
    [B, N, J/2] uint8, exponents [B, N, J/32] int8, J a multiple of 32. Returns N."""
    check_shape(op, "q", q_BSIJ, (None, None, None, None))
    b, _, _, j = q_BSIJ.shape
    require(j % 32 == 0, f"{op}: index_head_dim {j} is not a multiple of 32 (one scale per 32 channels)")
    check_shape(op, "codes", codes_BNH, (b, None, j // 2))
    n = codes_BNH.shape[1]
    check_shape(op, "exps", exps_BNG, (b, n, j // 32))
    check_dtype(op, "codes", codes_BNH, (torch.uint8,))
    check_dtype(op, "exps", exps_BNG, (torch.int8,))
    return n


def exponent_words(op: str, exps_BNG: torch.Tensor, j: int, cfg: dict) -> torch.Tensor:
    """The FP8 path's exponents: viewed as int32 words, four exponents per 32-bit load, where they
    pack into whole words (J = 128: one word per entry); cfg["EXP_WORDS"] set to the choice (an
    override of True is refused where they do not pack)."""
    exps = exps_BNG.contiguous()
    words = (j // 32) % 4 == 0 and exps.storage_offset() % 4 == 0
    cfg.setdefault("EXP_WORDS", words)
    require(words or not cfg["EXP_WORDS"], f"{op}: EXP_WORDS needs J / 32 = {j // 32} exponents per entry "
            "to be a multiple of 4 and a 4-byte aligned exps tensor")
    return exps.view(torch.int32) if cfg["EXP_WORDS"] else exps


def fp4_mma_config(rows: int, n: int, device: torch.device) -> dict:
    """Launch settings of the FP8 tensor-core path (fp4_mma.py) for `rows` query rows of n entries.
    Few programs (one row: 64 of the batch form's at 128K, under one per SM): 64-entry blocks, 4
    per program sharing one query split, each skipped whole when nothing sees it. Otherwise (a
    decode batch) runs of 16 blocks of 128 entries in a 3-stage pipelined loop, 4 warps. H200
    sweeps at 128K (docs/benchmarks.md, session 19): one row 9.3 us against 19.6 for the batch
    form; 64 rows 344.7 us against 570.0 for the one-row form; 2 rows (128 batch-form programs)
    20.3 against 22.7, 4 rows 41.9 against 33.1. Dropped at 64 rows: 8 warps (487 us against 394
    in an earlier run), 256-entry blocks (465), 2 or 4 stages (410 / 400)."""
    branch = {"BLOCK_N": 64, "BLOCKS": 4, "num_warps": 4}
    batch = {"BLOCK_N": 128, "BLOCKS": 16, "STAGES": 3, "num_warps": 4}
    if device.type != "cuda":
        return branch
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return batch if rows * cdiv(n, batch["BLOCK_N"] * batch["BLOCKS"]) >= sms else branch


def pipelined_config(rows: int, n: int, dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The JIT launch's settings for long rows of bf16/fp16 keys: 4 blocks of 128 entries per
    program in a 3-stage pipelined loop, 8 warps, where that still leaves 1.5 programs per SM.
    H200 sweeps (scripts/bench_kernels.py --sweep-parts index, 2026-12-03, keys in L2): 7.9 us at
    128K entries against 9.3 us for one 64-entry block per program (Reindex pool: 6.8 against 7.6),
    after a 256 MB read 14.2 against 16.0 us. At 64K (one program per SM) no better than single
    128-entry blocks (5.2 against 4.9 us), below that slower (16K: 4.9 against 2.4 us). The
    TensorRT build keeps launch_config (N is not known when its kernel is compiled)."""
    if device.type != "cuda" or dtype not in HALF_FLOATS or dim > 128:
        return {}
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    cfg = pipelined_launch()
    if 2 * rows * cdiv(n, cfg["BLOCKS"] * cfg["BLOCK_N"]) < 3 * sms:
        return {}
    return cfg


def pipelined_launch() -> dict:
    """The pipelined loop's settings (added to launch_config), for the JIT launch of long rows and
    the TensorRT plugin's second tactic. Needs 16-bit keys and index_head_dim <= 128."""
    return {"BLOCK_N": 128, "BLOCKS": 4, "STAGES": 3, "num_warps": 8}


def launch_config(heads: int, dim: int, dtype: torch.dtype) -> dict:
    """Block sizes and warps, shared by the JIT launch and the AOT compile (trt.py)."""
    return dict(BLOCK_N=64 if dim <= 128 else 32, BLOCK_I=min(next_pow2(heads, 16), 32),
                BLOCK_J=next_pow2(dim, 16), IEEE=dtype == torch.float32, num_warps=4)
