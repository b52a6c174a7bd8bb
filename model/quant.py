"""The model's own quantisation round-trips (ARCHITECTURE.md Part B §2 "QAT round-trips").

These are value-level simulations (quantise, then dequantise in the input dtype); storage stays
bf16/fp32 in the reference. Enabled by `ModelConfig.kv_qat`.
  window KV:      FP8 e4m3 per 32 channels, power-of-two scale 2^ceil(log2(max(amax,1e-4)/448))
  index q / k:    FP4 e2m1 per 32, power-of-two scale 2^ceil(log2(max(amax, 6*2^-126)/6))
  compressed KV:  FP4 e2m1 per 16, e4m3-rounded scale e4m3(max(amax, 6*2^-9)/6)
"""

from __future__ import annotations

import torch

from dsflash.model.dtypes import f32
from dsflash.plugins.dtypes import E2M1_GRID

E4M3_MAX = 448.0


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.shape[-1] % block:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of the quantisation block {block}")
    return f32(x).unflatten(-1, (x.shape[-1] // block, block))


def _pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    # exponent + 1 when the mantissa is non-zero, read from the fp32 value (exact, unlike log2).
    mant, exp = torch.frexp(v)
    return torch.ldexp(torch.ones_like(v), torch.where(mant == 0.5, exp - 1, exp))


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round to the e2m1 grid (|v| <= 6 assumed), nearest, ties to the even code."""
    grid = torch.tensor(E2M1_GRID, dtype=v.dtype, device=v.device)
    mag = v.abs()
    mids = (grid[1:] + grid[:-1]) / 2
    code = torch.bucketize(mag, mids)  # mag == mid goes to the lower code
    tie_up = torch.isin(mag, mids) & (code % 2 == 1)  # at a tie the even code wins
    code = code + tie_up.long()
    return torch.copysign(grid[code], v)


def fp8_e4m3_qat(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True)
    s = _pow2_ceil(amax.clamp_min(1e-4) * (1.0 / E4M3_MAX))
    q = (xb / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return (q * s).flatten(-2).to(x.dtype)


def _fp4_pow2(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(e2m1 grid values [..., blocks, block], power-of-two scales [..., blocks, 1])."""
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True)
    s = _pow2_ceil(amax.clamp_min(6 * 2.0**-126) / 6.0)
    return round_e2m1((xb / s).clamp(-6.0, 6.0)), s


def fp4_pow2_qat(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    v, s = _fp4_pow2(x, block)
    return (v * s).flatten(-2).to(x.dtype)


def fp4_pow2_pack(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The storage behind fp4_pow2_qat (the release's indexer keys, 68 B per 128-dim entry):
    e2m1 codes two per byte (even channel in the low nibble; bit 3 = sign, bits 0-2 = the grid
    index of E2M1_GRID) and each block's power-of-two scale as its int8 exponent.
    plugins/csa2_index_score/reference.py:unpack_keys_fp4 inverts it: unpack(pack(x)) == qat(x)."""
    v, s = _fp4_pow2(x, block)
    v = v.flatten(-2)
    grid = torch.tensor(E2M1_GRID, dtype=v.dtype, device=v.device)
    code = torch.searchsorted(grid, v.abs()) | (torch.signbit(v).long() << 3)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (torch.frexp(s)[1] - 1).squeeze(-1).to(torch.int8)


def fp4_e4m3scale_qat(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    xb = _blocks(x, block)
    amax = xb.abs().amax(-1, keepdim=True)
    s = (amax.clamp_min(6 * 2.0**-9) / 6.0).to(torch.float8_e4m3fn).float()
    return (round_e2m1((xb / s).clamp(-6.0, 6.0)) * s).flatten(-2).to(x.dtype)
