"""The model's own quantisation round-trips (ARCHITECTURE.md Part B §2 "QAT round-trips").

These are value-level simulations (quantise, then dequantise in the input dtype), enabled by
`ModelConfig.kv_qat`. The cache keeps the window KV in the model dtype, and the index keys and
compressed entries packed as the release stores them (fp4_pow2_pack, fp4_e4m3scale_pack): the
values are the same.
  window KV:      FP8 e4m3 per 32 channels, power-of-two scale 2^ceil(log2(max(amax,1e-4)/448))
  index q / k:    FP4 e2m1 per 32, power-of-two scale 2^ceil(log2(max(amax, 6*2^-126)/6))
  compressed KV:  FP4 e2m1 per 16, e4m3-rounded scale e4m3(max(amax, 6*2^-9)/6)

Every rounding is a round-half-to-even at the value's step in its float format (e4m3, e2m1), from
exact exponents and powers of two (floor_log2, plugins/dtypes.py:exact_pow2): frexp and bit
patterns eagerly; while exporting, operations that standard ONNX has (it has no frexp, bitcast,
bucketize or Log2), which run in ONNX Runtime bit for bit as the eager ones. The model's export
takes each round-trip as one node instead (OpSet.qat_node, plugins/qat_round/node.py), written
out as the same exact maths in ONNX ops (onnx_form.py), which spares torch.export tracing these
forms op by op. No eager step builds a constant tensor, so the round-trips run inside
CUDA-graph capture. tests/test_quant.py checks each against torch's frexp and float8 cast.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from dsflash.model.dtypes import f32
from dsflash.plugins.dtypes import E2M1_GRID
from dsflash.plugins.dtypes import exact_pow2 as pow2

E4M3_MAX = 448.0
# e4m3: 3 mantissa bits, smallest normal exponent -6 (below it, subnormal steps of 2^-9)
E4M3_MANTISSA_BITS, E4M3_MIN_EXP, E4M3_MAX_EXP = 3, -6, 8
# fp32's normal exponents: the power-of-two scales live there
F32_MIN_EXP, F32_MAX_EXP = -126, 127
# e2m1 rounding boundaries: halfway between neighbouring grid magnitudes
E2M1_MIDS = tuple((a + b) / 2 for a, b in pairwise(E2M1_GRID))


def check_block(x: torch.Tensor, block: int) -> None:
    """A ValueError naming the last dim and the block unless the block divides it."""
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation block {block}")


def packed_storage(x: torch.Tensor, block: int,
                   side_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty outputs of a pack of x (fp4_pow2_pack, fp4_e4m3scale_pack): codes [..., D/2] uint8 and
    one side value per block [..., D/block] in side_dtype (the Triton launches and the export's
    one-node form allocate these)."""
    check_block(x, block)
    *lead, d = x.shape
    return (x.new_empty((*lead, d // 2), dtype=torch.uint8), x.new_empty((*lead, d // block), dtype=side_dtype))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    check_block(x, block)
    return f32(x).unflatten(-1, (x.shape[-1] // block, block))


def floor_log2(v: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """floor(log2 v) for v >= 0 as an exact int64, clamped to [lo, hi] (v = 0 gives lo). Eagerly
    frexp's exponent. While exporting (ONNX has neither frexp nor Log2; Log(v)/Log(2) can be one
    off next to a power of two): that guess, settled by comparing v with the exact power at the
    guess and twice it."""
    if not torch.compiler.is_exporting():
        e = (torch.frexp(v)[1] - 1).long()
        return torch.where(v > 0, e, lo).clamp(lo, hi)
    guess = torch.floor(torch.log2(v)).clamp(lo, hi).long()
    p = pow2(guess, lo, hi)
    e = guess - (p > v).long() + (p * 2 <= v).long()
    return e.clamp(lo, hi)


def ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """ceil(log2 v) for fp32-normal v > 0 as an exact int64 (the exponent of a power-of-two scale)."""
    if not torch.compiler.is_exporting():  # frexp: v = m 2^x, m in [0.5, 1); a power of two has m = 0.5
        mant, exp = torch.frexp(v)
        return torch.where(mant == 0.5, exp - 1, exp).long()
    e = floor_log2(v, F32_MIN_EXP, F32_MAX_EXP)
    return e + (pow2(e, F32_MIN_EXP, F32_MAX_EXP) < v).long()


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    return pow2(ceil_log2(v), F32_MIN_EXP, F32_MAX_EXP + 1)


def _round_at_step(v: torch.Tensor, mantissa_bits: int, min_exp: int, max_exp: int) -> torch.Tensor:
    """v rounded half-to-even at its step in a float format of `mantissa_bits` mantissa bits and
    normal exponents from min_exp (below it subnormal steps 2^(min_exp - mantissa_bits)): the
    format's nearest value, ties to the even code, for |v| within its range."""
    e = floor_log2(v.abs(), min_exp, max_exp) - mantissa_bits
    step = pow2(e, min_exp - mantissa_bits, max_exp - mantissa_bits)
    return torch.round(v / step) * step


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest e4m3 value (ties to even), as fp32; |v| beyond 448 saturates to 448
    (torch's float8_e4m3fn cast would give NaN there). Equal to the float8 cast within range."""
    return _round_at_step(v.clamp(-E4M3_MAX, E4M3_MAX), E4M3_MANTISSA_BITS, E4M3_MIN_EXP, E4M3_MAX_EXP)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round to the e2m1 grid (|v| <= 6 assumed), nearest, ties to the even code: e2m1 is a float
    format of one mantissa bit and exponents 0..2 (0, .5, 1, 1.5 | 2, 3 | 4, 6)."""
    return _round_at_step(v, 1, 0, 2).to(v.dtype)


def _e2m1_code(mag: torch.Tensor) -> torch.Tensor:
    """Grid index (0-7) of an e2m1 magnitude on the grid: 2m below 2, else 2 + 2e + 2(m/2^e - 1)
    for m = 2^e (1 + f)."""
    e = floor_log2(mag, 1, 2)
    high = 2 + 2 * e + (2 * (mag / pow2(e, 1, 2) - 1)).long()
    return torch.where(mag < 2, (mag * 2).long(), high)


def fp8_e4m3_qat(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True)
    s = _pow2_ceil(amax.clamp_min(1e-4) * (1.0 / E4M3_MAX))
    return (round_e4m3(xb / s) * s).flatten(-2).to(x.dtype)


def _fp4_pow2(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e2m1 grid values [..., blocks, block], power-of-two scales [..., blocks, 1], their
    exponents [..., blocks, 1] int64)."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True)
    e = ceil_log2(amax.clamp_min(6 * 2.0**-126) / 6.0)
    s = pow2(e, F32_MIN_EXP, F32_MAX_EXP + 1)
    return round_e2m1((xb / s).clamp(-6.0, 6.0)), s, e


def fp4_pow2_qat(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    v, s, _ = _fp4_pow2(x, block)
    return (v * s).flatten(-2).to(x.dtype)


def fp4_pow2_pack(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The storage behind fp4_pow2_qat (the release's indexer keys, 68 B per 128-dim entry):
    e2m1 codes two per byte (even channel in the low nibble; bit 3 = sign, bits 0-2 = the grid
    index of E2M1_GRID; a zero packs as +0) and each block's power-of-two scale as its int8
    exponent. plugins/csa2_index_score/reference.py:unpack_keys_fp4 inverts it:
    unpack(pack(x)) == qat(x)."""
    v, _, e = _fp4_pow2(x, block)
    return _pack_e2m1(v.flatten(-2)), e.squeeze(-1).to(torch.int8)


def _pack_e2m1(v: torch.Tensor) -> torch.Tensor:
    """e2m1 grid values [..., D] -> codes two per byte [..., D/2] uint8 (even channel in the low
    nibble; bit 3 the sign, bits 0-2 the grid index; a zero packs as +0)."""
    code = _e2m1_code(v.abs()) + (v < 0).long() * 8
    return (code[..., 0::2] + code[..., 1::2] * 16).to(torch.uint8)


def _fp4_e4m3scale(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e2m1 grid values [..., blocks, block], e4m3 scales [..., blocks, 1]), both fp32."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True)
    s = round_e4m3(amax.clamp_min(6 * 2.0**-9) / 6.0)
    return round_e2m1((xb / s).clamp(-6.0, 6.0)), s


def fp4_e4m3scale_qat(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    v, s = _fp4_e4m3scale(x, block)
    return (v * s).flatten(-2).to(x.dtype)


def e4m3_code(s: torch.Tensor) -> torch.Tensor:
    """The float8_e4m3fn bits (int64, 0-126) of e4m3 values s in [0, 448]: exponent field E (bias
    7) times 8 plus the mantissa m; E = 0 holds the subnormals m 2^-9. Arithmetic, so that it
    exports (equal to torch's float8 cast's bits: tests/test_quant.py)."""
    e = floor_log2(s, E4M3_MIN_EXP, E4M3_MAX_EXP)
    normal = s >= 2.0**E4M3_MIN_EXP
    mant = torch.where(normal, s / pow2(e, E4M3_MIN_EXP, E4M3_MAX_EXP) * 8 - 8, s * 2.0**9)
    return torch.where(normal, (e + 7) * 8, 0) + mant.long()


def fp4_e4m3scale_pack(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The storage behind fp4_e4m3scale_qat (the release's compressed KV entries, 288 B per
    512-dim entry instead of 1,024 in bf16): e2m1 codes two per byte as fp4_pow2_pack packs them,
    and each 16-channel block's e4m3 scale as its float8_e4m3fn bits (uint8).
    plugins/csa2_sparse_attention/reference.py:unpack_entries_fp4 inverts it: unpack(pack(x)) ==
    qat(x)."""
    v, s = _fp4_e4m3scale(x, block)
    return _pack_e2m1(v.flatten(-2)), e4m3_code(s.squeeze(-1)).to(torch.uint8)
