"""The kv_qat round-trips as one Triton launch each, bit for bit as their references in
model/quant.py (the spec; same signatures): fp8_e4m3_qat (window KV), fp4_pow2_qat (index
queries), fp4_pow2_pack (index keys as stored) and fp4_e4m3scale_pack (compressed entries as
stored).

Why: eagerly each reference is some 20-35 small PyTorch kernels (block amax, exponent, power of
two, rounding at the step, codes), about 1.6-2 ms of a graphed decode step at batch 1 (H200,
docs/benchmarks.md, sessions 22-23). The graphs keep the reference's standard ops (TensorRT fuses
pointwise chains), and a compiled step traces the references too (inductor fuses them).

Each program takes BLOCKS quantisation blocks (rows of BS contiguous values), as two planes of
their even and odd channels, the form the packed codes need (a code byte holds channels 2j
and 2j + 1). The maths works on fp32 bits: floor(log2 |v|) is the exponent field, 2^e is built from bits
(csa2_index_score.kernel.exact_pow2), a round half to even at the step is (q + 1.5 2^23) -
1.5 2^23 (exact for |q| < 2^22: q is at most 16 here), and divisions by a scale that is not a power of
two are correctly rounded (div_rn), as PyTorch's are. tests/test_qat_kernel.py checks every form
bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.model.quant import packed_storage
from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.csa2_index_score.kernel import exact_pow2
from dsflash.plugins.launch import check_device, check_dtype, require

FP8_POW2, FP4_POW2, FP4_E4M3 = 0, 1, 2  # the scale and grid of a mode (model/quant.py's docstring)
BLOCKS = 32  # quantisation blocks per program


@triton.jit
def _exponent(v):
    """floor(log2 |v|) of fp32 v from its exponent field (int32); zeros and subnormals give -127."""
    return ((v.to(tl.int32, bitcast=True) >> 23) & 255) - 127


@triton.jit
def _round_at_step(v, MANT: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr):
    """model/quant.py:_round_at_step: v to MANT mantissa bits at its exponent clamped to [LO, HI]."""
    e = tl.minimum(tl.maximum(_exponent(v), LO), HI) - MANT
    q = v * exact_pow2(-e)  # exact: a power of two (multiplied, since fp32 division may be approximate)
    return ((q + 12582912.0) - 12582912.0) * exact_pow2(e)  # half to even (|q| < 2^22)


@triton.jit
def _ceil_log2(v):
    """ceil(log2 v) for fp32-normal v > 0."""
    e = _exponent(v)
    return e + ((v.to(tl.int32, bitcast=True) & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _e2m1_code(r):
    """Code (bit 3 the sign, bits 0-2 the grid index) of an e2m1 grid value r."""
    mag = tl.abs(r)
    e = tl.minimum(tl.maximum(_exponent(mag), 1), 2)
    high = 2 + 2 * e + (2 * (mag * exact_pow2(-e) - 1)).to(tl.int32)
    code = tl.where(mag < 2, (mag * 2).to(tl.int32), high)
    return code + 8 * (r < 0).to(tl.int32)


@triton.jit
def qat_round_kernel(x_ptr, NB, out_ptr, side_ptr, BS: tl.constexpr, MODE: tl.constexpr, PACK: tl.constexpr,
                     BLOCKS: tl.constexpr):
    """Blocks [NB, BS] of x: MODE's round-trip, written as values in x's dtype to out_ptr [NB, BS]
    or, with PACK, as codes [NB, BS/2] (uint8) to out_ptr and each block's exponent (int8,
    FP4_POW2) or e4m3 scale bits (uint8, FP4_E4M3) to side_ptr [NB]."""
    blk = tl.program_id(0).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
    live = blk < NB
    j = tl.arange(0, BS // 2)
    at = blk[:, None] * BS + 2 * j[None, :]
    m = live[:, None]
    xe = tl.load(x_ptr + at, mask=m, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + at + 1, mask=m, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))[:, None]
    if MODE == 0:  # FP8_POW2: e4m3 values, scale 2^ceil(log2(max(amax, 1e-4) / 448))
        e = _ceil_log2(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
        s = exact_pow2(e)
        inv = exact_pow2(-e)
        re = _round_at_step(tl.minimum(tl.maximum(xe * inv, -448.0), 448.0), 3, -6, 8)
        ro = _round_at_step(tl.minimum(tl.maximum(xo * inv, -448.0), 448.0), 3, -6, 8)
    else:
        six = tl.full(amax.shape, 6.0, tl.float32)
        if MODE == 1:  # FP4_POW2: scale 2^ceil(log2(max(amax, 6 2^-126) / 6))
            e = _ceil_log2(tl.math.div_rn(tl.maximum(amax, 6 * 2.0**-126), six))
            s = exact_pow2(e)
        else:  # FP4_E4M3: scale e4m3(max(amax, 6 2^-9) / 6), saturating at 448
            y = tl.math.div_rn(tl.maximum(amax, 6 * 2.0**-9), six)
            s = _round_at_step(tl.minimum(y, 448.0), 3, -6, 8)
        sb = tl.broadcast_to(s, xe.shape)
        re = _round_at_step(tl.minimum(tl.maximum(tl.math.div_rn(xe, sb), -6.0), 6.0), 1, 0, 2)
        ro = _round_at_step(tl.minimum(tl.maximum(tl.math.div_rn(xo, sb), -6.0), 6.0), 1, 0, 2)
    if PACK:
        code = _e2m1_code(re) + 16 * _e2m1_code(ro)
        tl.store(out_ptr + blk[:, None] * (BS // 2) + j[None, :], code.to(tl.uint8), mask=m)
        if MODE == 1:
            side = e
        else:  # e4m3 bits: exponent field (bias 7) x 8 + mantissa; subnormals m 2^-9
            se = tl.minimum(tl.maximum(_exponent(s), -6), 8)
            normal = s >= 2.0**-6
            mant = tl.where(normal, s * exact_pow2(-se) * 8 - 8, s * 512.0).to(tl.int32)
            side = tl.where(normal, (se + 7) * 8, 0) + mant
        tl.store(side_ptr + blk, tl.reshape(side, [BLOCKS]).to(side_ptr.dtype.element_ty), mask=live)
    else:
        out_e = (re * s).to(out_ptr.dtype.element_ty)
        out_o = (ro * s).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + at, out_e, mask=m)
        tl.store(out_ptr + at + 1, out_o, mask=m)


def _launch(x: torch.Tensor, block: int, mode: int, pack: bool):
    op = ("fp8_e4m3_qat", "fp4_pow2_qat", "fp4_e4m3scale_qat")[mode] + (" (pack)" if pack else "")
    check_dtype(op, "x", x, (torch.float32, torch.bfloat16, torch.float16))
    check_device(op, x=x)
    require(block in (16, 32, 64) and x.shape[-1] % block == 0,
            f"{op}: last dim {x.shape[-1]} is not a multiple of the quantisation block {block} (16, 32 "
            "or 64)")
    x = x.contiguous()
    nb = x.numel() // block
    if pack:
        out, side = packed_storage(x, block, torch.int8 if mode == FP4_POW2 else torch.uint8)
    else:
        out, side = torch.empty_like(x), x
    if nb:
        qat_round_kernel[(cdiv(nb, BLOCKS),)](x, nb, out, side, BS=block, MODE=mode, PACK=pack, BLOCKS=BLOCKS,
                                             num_warps=4)
    return (out, side) if pack else out


def fp8_e4m3_qat(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _launch(x, block, FP8_POW2, False)


def fp4_pow2_qat(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _launch(x, block, FP4_POW2, False)


def fp4_pow2_pack(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, block, FP4_POW2, True)


def fp4_e4m3scale_pack(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x, block, FP4_E4M3, True)
