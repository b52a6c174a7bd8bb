"""Csa2EntriesFp4 as a Triton kernel: kv_qat's compressed entries decoded from their FP4 storage
(model/quant.py:fp4_e4m3scale_pack: e2m1 codes two per byte, an e4m3 scale per 16 channels) for
the rows a selection names (reference.py:csa2_entries_fp4).

Each program decodes ROWS output rows: it reads each row's entry id, the entry's D/2 code bytes
and D/16 scale bytes, and writes D values in the output dtype. Everything is arithmetic on the
bits (no table): e2m1 codes as the FP4 index kernels decode them
(csa2_index_score.kernel.e2m1_nibble_values); an e4m3 scale with exponent field E >= 1 is the fp32
with exponent E - 7 and the same 3 mantissa bits, with E = 0 it is m 2^-9. A grid value times a
scale has at most 6 significant bits, so the product is exact in every output dtype: the kernel
equals the reference bit for bit.

A decode step decodes the K rows each query row selects (K x D/2 + K x D/16 bytes read instead of
K x 2D for bf16 entries; 288 B per 512-dim entry); the attention then reads them from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.csa2_index_score.kernel import e2m1_nibble_values
from dsflash.plugins.launch import check_device, check_dtype, check_shape, next_pow2, require
from dsflash.plugins.pdl import pdl_launch_args, wait_for_earlier_grids

ROWS = 8  # output rows per program; 4 warps over [8, 256] code bytes at the released head_dim 512


@triton.jit
def _e4m3(bits):
    """fp32 value of float8_e4m3fn bits (int32 0-126: no sign, no NaN)."""
    e = bits >> 3
    m = bits & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e > 0, normal, m.to(tl.float32) * 0.001953125)  # 2^-9


@triton.jit
def csa2_entries_fp4_kernel(q_ptr, codes_ptr, scales_ptr, idx_ptr, N, R, TOTAL, out_ptr,
                            C: tl.constexpr, CP: tl.constexpr, ROWS: tl.constexpr,
                            PDL: tl.constexpr = False):
    """Grid (cdiv(TOTAL, ROWS),): output rows t = b R + r of out [B, R, 2C] (TOTAL = B R) take
    entry idx[t] of batch row b from codes [B, N, C] and scales [B, N, C/8]; an id outside [0, N)
    gives zeros. q_ptr is the output dtype's carrier (not read)."""
    wait_for_earlier_grids(PDL)
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    live = t < TOTAL
    ent = tl.load(idx_ptr + t, mask=live, other=-1)
    ok = live & (ent >= 0) & (ent < N)
    src = (t // R) * N + tl.where(ok, ent, 0)  # entry row in [B*N]
    j = tl.arange(0, CP)
    in_row = j < C
    m2 = ok[:, None] & in_row[None, :]
    byte = tl.load(codes_ptr + src[:, None] * C + j[None, :], mask=m2, other=0).to(tl.int32)
    sbits = tl.load(scales_ptr + src[:, None] * (C // 8) + (j // 8)[None, :], mask=m2, other=0).to(tl.int32)
    scale = _e4m3(sbits)
    lo = e2m1_nibble_values(byte & 15) * scale  # channel 2j
    hi = e2m1_nibble_values(byte >> 4) * scale  # channel 2j + 1
    vals = tl.interleave(lo, hi)  # [ROWS, 2 CP], channels in order
    d = tl.arange(0, 2 * CP)
    tl.store(out_ptr + t[:, None] * (2 * C) + d[None, :], vals.to(out_ptr.dtype.element_ty),
             mask=live[:, None] & (d < 2 * C)[None, :])


def check_entries_fp4(op: str, codes_BNC: torch.Tensor, scales_BNG: torch.Tensor,
                      idx_BSK: torch.Tensor) -> int:
    """kv_qat entries as model/quant.py:fp4_e4m3scale_pack stores them: codes [B, N, D/2] and scales
    [B, N, D/16], both uint8, D a multiple of 16; ids [B, S, K] int64. Returns N."""
    check_shape(op, "codes", codes_BNC, (None, None, None))
    b, n, c = codes_BNC.shape
    require(c % 8 == 0, f"{op}: codes hold {c} bytes per entry, not a multiple of 8 (a scale per 16 "
            "channels)")
    check_shape(op, "scales", scales_BNG, (b, n, c // 8))
    check_shape(op, "idx", idx_BSK, (b, None, None))
    check_dtype(op, "codes", codes_BNC, (torch.uint8,))
    check_dtype(op, "scales", scales_BNG, (torch.uint8,))
    check_dtype(op, "idx", idx_BSK, (torch.int64,))
    return n


def csa2_entries_fp4(q_BSHD: torch.Tensor, codes_BNC: torch.Tensor, scales_BNG: torch.Tensor,
                     idx_BSK: torch.Tensor, *, overrides: dict | None = None) -> torch.Tensor:
    """The reference's (reference.py:csa2_entries_fp4) signature: [B, S*K, D] in q's dtype.
    `overrides`: ROWS, num_warps, PDL (sweeps, tests)."""
    op = "Csa2EntriesFp4"
    n = check_entries_fp4(op, codes_BNC, scales_BNG, idx_BSK)
    check_dtype(op, "q", q_BSHD, (torch.float32, torch.bfloat16, torch.float16))
    check_device(op, q=q_BSHD, codes=codes_BNC, scales=scales_BNG, idx=idx_BSK)
    b, s, k = idx_BSK.shape
    c = codes_BNC.shape[2]
    out = torch.empty(b, s * k, 2 * c, dtype=q_BSHD.dtype, device=codes_BNC.device)
    if out.numel() == 0:
        return out
    over = dict(overrides or {})
    rows = over.get("ROWS", ROWS)
    pdl = pdl_launch_args(codes_BNC.device, {"PDL": over.get("PDL", True)})
    csa2_entries_fp4_kernel[(cdiv(b * s * k, rows),)](
        q_BSHD, codes_BNC.contiguous(), scales_BNG.contiguous(), idx_BSK.contiguous(), n, s * k, b * s * k,
        out, C=c, CP=next_pow2(c), ROWS=rows, num_warps=over.get("num_warps", 4), **pdl)
    return out
