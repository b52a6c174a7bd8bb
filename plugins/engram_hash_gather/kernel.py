"""EngramHashGather as one Triton kernel: hash every (token, order, head) column and copy its
table row to the output, in a single pass (no row-id tensor in memory).

Grid: (B * S tokens, column blocks). Each program re-derives the rolling hash of its token (a
handful of integer ops on look + 1 ids) and gathers BLOCK_J rows of D elements. The table may be
a CUDA tensor or a pinned host tensor (read over PCIe through unified addressing, for tables
larger than HBM). Multipliers, primes and offsets are compile-time constants (one compile per
Engram layer), so a call copies nothing to the device and can be captured in a CUDA graph. FP8
tables carry one fp32 scale per row and give bf16 rows.

`engram_hash_gather` / `engram_hash_gather_fp8` have the signatures of the references beside
them (reference.py) and assert the same preconditions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.launch import check_device, check_dtype, check_shape, next_pow2, require


@triton.jit
def _hash_gather_rows(cids_ptr, table_ptr, scales_ptr, out_ptr, n_new,
                      LOOK: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr, MULT: tl.constexpr,
                      PRIMES: tl.constexpr, OFFSETS: tl.constexpr, PAD_ID: tl.constexpr,
                      BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SCALES: tl.constexpr):
    tok = tl.program_id(0)
    b = tok // n_new
    p = tok % n_new
    n_cols: tl.constexpr = LOOK * HEADS
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    jmask = j < n_cols
    shift_of_col = j // HEADS + 1  # column (s-1)*H + h hashes the n-gram of order s+1 ending here
    row_base = cids_ptr + b.to(tl.int64) * (LOOK + n_new) + p
    hashed = tl.zeros([BLOCK_J], dtype=tl.int64)
    blocked = tl.load(row_base + LOOK) < 0
    for s in tl.static_range(LOOK + 1):
        t = tl.load(row_base + (LOOK - s))
        blocked = blocked | (t < 0)  # a dead id blocks every longer n-gram (sticky)
        term = tl.where(blocked, PAD_ID, t).to(tl.int64) * MULT[s]
        if s == 0:
            rolling = term
        else:
            rolling = rolling ^ term
            hashed = tl.where(shift_of_col == s, rolling, hashed)
    # primes and offsets are compile-time constants (attributes): pick each column's pair
    prime = tl.full([BLOCK_J], 1, dtype=tl.int64)
    offset = tl.zeros([BLOCK_J], dtype=tl.int64)
    for c in tl.static_range(n_cols):
        prime = tl.where(j == c, PRIMES[c], prime)
        offset = tl.where(j == c, OFFSETS[c], offset)
    rows = hashed % prime + offset
    if HAS_SCALES:
        row_scale = tl.load(scales_ptr + rows, mask=jmask, other=0.0)
    out_base = out_ptr + tok.to(tl.int64) * n_cols * D
    for d0 in tl.static_range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m2 = jmask[:, None] & (d < D)[None, :]
        vals = tl.load(table_ptr + rows[:, None] * D + d[None, :], mask=m2, other=0.0)
        if HAS_SCALES:
            vals = vals.to(tl.float32) * row_scale[:, None]
        tl.store(out_base + j[:, None] * D + d[None, :], vals.to(out_ptr.dtype.element_ty), mask=m2)


# Entry points in TensorRT's AOT order: input tensors, integer scalars, output tensors.
@triton.jit
def engram_hash_gather_kernel(cids_ptr, table_ptr, n_new, out_ptr,
                              LOOK: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
                              MULT: tl.constexpr, PRIMES: tl.constexpr, OFFSETS: tl.constexpr,
                              PAD_ID: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    _hash_gather_rows(cids_ptr, table_ptr, table_ptr, out_ptr, n_new, LOOK, HEADS, D, MULT, PRIMES,
                      OFFSETS, PAD_ID, BLOCK_J, BLOCK_D, False)


@triton.jit
def engram_hash_gather_fp8_kernel(cids_ptr, table_ptr, scales_ptr, n_new, out_ptr,
                                  LOOK: tl.constexpr, HEADS: tl.constexpr, D: tl.constexpr,
                                  MULT: tl.constexpr, PRIMES: tl.constexpr, OFFSETS: tl.constexpr,
                                  PAD_ID: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr):
    _hash_gather_rows(cids_ptr, table_ptr, scales_ptr, out_ptr, n_new, LOOK, HEADS, D, MULT, PRIMES,
                      OFFSETS, PAD_ID, BLOCK_J, BLOCK_D, True)


def launch_config(look: int, heads: int, dim: int) -> dict:
    """Block sizes and warps, shared by the JIT launch and the AOT compile (trt.py)."""
    return dict(BLOCK_J=min(next_pow2(look * heads), 16), BLOCK_D=min(next_pow2(dim, 16), 128), num_warps=4)


def _check(cids_BT, table_ND, multipliers, primes, offsets, heads, op):
    look = len(multipliers) - 1
    check_dtype(op, "cids", cids_BT, (torch.int64,))
    require(cids_BT.dim() == 2 and cids_BT.shape[1] > look,
            f"{op}: cids has shape {tuple(cids_BT.shape)}; needs [B, look + S] with look = {look}, S >= 1")
    require(len(primes) == len(offsets) == look * heads,
            f"{op}: {len(primes)} primes / {len(offsets)} offsets, expected look * heads = {look * heads}")
    check_shape(op, "table", table_ND, (None, None))
    n_rows = table_ND.shape[0]
    end = max(o + p for o, p in zip(offsets, primes))
    require(end <= n_rows, f"{op}: offsets + primes reach row {end}, the table has {n_rows} rows")
    require(min(offsets) >= 0 and min(primes) >= 1, f"{op}: offsets must be >= 0 and primes >= 1")
    require(table_ND.is_contiguous(), f"{op}: the table must be contiguous (strides {table_ND.stride()})")
    check_device(op, cids=cids_BT)
    if table_ND.device.type == "cpu" and not table_ND.is_pinned():
        check_device(op, table=table_ND)  # a host table must be pinned to be read by the GPU


def _launch(cids_BT, table_ND, scales_N, out_dtype, multipliers, primes, offsets, pad_id, heads):
    look = len(multipliers) - 1
    cids = cids_BT.contiguous()
    b, n_new = cids.shape[0], cids.shape[1] - look
    d = table_ND.shape[1]
    out = torch.empty(b, n_new, look * heads, d, dtype=out_dtype, device=cids.device)
    if out.numel() == 0:
        return out
    cfg = launch_config(look, heads, d)
    grid = (b * n_new, cdiv(look * heads, cfg["BLOCK_J"]))
    consts = dict(LOOK=look, HEADS=heads, D=d, MULT=tuple(int(m) for m in multipliers),
                  PRIMES=tuple(int(p) for p in primes), OFFSETS=tuple(int(o) for o in offsets),
                  PAD_ID=int(pad_id), **cfg)
    if scales_N is None:
        engram_hash_gather_kernel[grid](cids, table_ND, n_new, out, **consts)
    else:
        engram_hash_gather_fp8_kernel[grid](cids, table_ND, scales_N, n_new, out, **consts)
    return out


def engram_hash_gather(cids_BT: torch.Tensor, table_ND: torch.Tensor, multipliers: list[int],
                       primes: list[int], offsets: list[int], pad_id: int, heads: int) -> torch.Tensor:
    op = "EngramHashGather"
    _check(cids_BT, table_ND, multipliers, primes, offsets, heads, op)
    check_dtype(op, "table", table_ND, (torch.float32, torch.bfloat16, torch.float16))
    return _launch(cids_BT, table_ND, None, table_ND.dtype, multipliers, primes, offsets, pad_id, heads)


def engram_hash_gather_fp8(cids_BT: torch.Tensor, table_ND: torch.Tensor, scales_N: torch.Tensor,
                           multipliers: list[int], primes: list[int], offsets: list[int], pad_id: int,
                           heads: int) -> torch.Tensor:
    op = "EngramHashGather(fp8)"
    _check(cids_BT, table_ND, multipliers, primes, offsets, heads, op)
    check_dtype(op, "table", table_ND, (torch.float8_e4m3fn,))
    check_dtype(op, "scales", scales_N, (torch.float32,))
    check_shape(op, "scales", scales_N, (table_ND.shape[0],))
    require(scales_N.device == table_ND.device,
            f"{op}: scales on {scales_N.device}, table on {table_ND.device}: keep them together")
    return _launch(cids_BT, table_ND, scales_N, torch.bfloat16, multipliers, primes, offsets, pad_id, heads)
