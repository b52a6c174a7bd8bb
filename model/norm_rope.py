"""RMSNorm and rotary embeddings (ARCHITECTURE.md Part B §5).

RMSNorm: y = w * x * rsqrt(mean(x^2) + eps), computed in fp32 and rounded once.
RoPE: interleaved pairs (2i, 2i+1) of the trailing `rope_dim` channels as complex numbers;
plain theta on window-only layers, compress theta + YaRN on compressed layers. cos/sin have unit
magnitude (no mscale), so the inverse rotation is the conjugate.

The angles pos x freq reach 1e6 rad at the flash preset's 1M positions, where an fp32 product is
off by up to 0.06 rad. The frequencies are fp64; the angles are formed in fp32 from exact pieces
(`rope_phase`, `rope_cos_sin`), reduced to [-pi, pi] before cos/sin: within about 5e-7 of cos/sin
of the fp64 angle for every position below POSITION_LIMIT. No fp64 op reaches the exported graphs:
TensorRT has no fp64 type, and its ONNX parser turns fp64 casts and weights into fp32 ones
(onnx-tensorrt `convertDtype`: DOUBLE -> kFLOAT), which would give back those 0.06 rad.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsflash.model.dtypes import cast, f32

# Positions split into PHASE_DIGITS digits of 8 bits: a digit times a multiple of 2^-16 with a
# 16-bit numerator is exact in fp32 (24 bits).
PHASE_DIGIT = 256
PHASE_DIGITS = 3
PHASE_COARSE = 1 << 16
# fp32 holds every integer below 2^24 exactly, and the top digit stays below PHASE_DIGIT
POSITION_LIMIT = PHASE_DIGIT ** PHASE_DIGITS


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = f32(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * f32(weight)
    return cast(y, x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_frequencies(rope_dim: int, theta: float, yarn: dict | None) -> torch.Tensor:
    """Angular frequency of each of the rope_dim/2 pairs, fp64 for exact positions later."""
    i = torch.arange(rope_dim // 2, dtype=torch.float64)
    freqs = theta ** (-2.0 * i / rope_dim)
    if yarn is None:
        return freqs
    factor = float(yarn["factor"])
    orig = float(yarn["original_max_position_embeddings"])

    def corr(rotations: float) -> float:
        return rope_dim * math.log(orig / (2 * math.pi * rotations)) / (2 * math.log(theta))

    low = max(math.floor(corr(float(yarn.get("beta_fast", 32)))), 0)
    high = min(math.ceil(corr(float(yarn.get("beta_slow", 1)))), rope_dim - 1)
    span = max(high - low, 1e-3)
    ramp = ((i - low) / span).clamp(0.0, 1.0)
    return freqs / factor * ramp + freqs * (1.0 - ramp)


def rope_phase(freqs: torch.Tensor) -> torch.Tensor:
    """fp32 [2 * PHASE_DIGITS, rope_dim/2] from fp64 frequencies: the turns (angle / 2pi) per
    PHASE_DIGIT^k positions modulo 1 for each digit k, split into a coarse part (a multiple of
    2^-16) and the fine rest (|rest| <= 2^-17): the coarse rows of every digit, then the fine."""
    turns = freqs.to(torch.float64) / (2 * math.pi)
    per_digit = torch.stack([torch.remainder(turns * PHASE_DIGIT ** k, 1.0) for k in range(PHASE_DIGITS)])
    coarse = torch.round(per_digit * PHASE_COARSE) / PHASE_COARSE
    return torch.cat((coarse, per_digit - coarse)).to(torch.float32)


def rope_cos_sin(pos: torch.Tensor, phase: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape pos.shape + [rope_dim/2] in fp32 for integer positions |pos| <
    POSITION_LIMIT, every op in fp32 (phase: `rope_phase`). With pos = sum of digit_k x
    PHASE_DIGIT^k, the turns pos x freq / 2pi modulo 1 are the sum of frac(digit_k x coarse_k),
    each product and fraction exact and their sum too, plus the fine products (|sum| <= 3 x 2^-9):
    one rounding of a sum below 0.51 in magnitude (2^-25 turns), then the angle in [-pi, pi].
    Error budget against cos/sin of the fp64 angle: 1.9e-7 (that rounding) + 1.2e-7 (x 2pi) +
    0.9e-7 (2pi in fp32) + cos/sin's own ~1 ulp, about 5e-7, under fp32's 2^-20 rounding floor
    (measured: 3.9e-7 over 200K positions up to 2^24, tests/test_rope.py)."""
    # floor(pos / PHASE_DIGIT^k), exact; the digits are their differences, the top one signed
    shifted = [pos.to(torch.float32).unsqueeze(-1)]
    for _ in range(PHASE_DIGITS - 1):
        shifted.append(torch.floor(shifted[-1] * (1.0 / PHASE_DIGIT)))
    digits = torch.cat([q - PHASE_DIGIT * up for q, up in zip(shifted, shifted[1:])] + shifted[-1:], dim=-1)
    digits = digits.unsqueeze(-1)  # [..., PHASE_DIGITS, 1]
    products = digits * phase[:PHASE_DIGITS]
    coarse = (products - torch.floor(products)).sum(-2)  # multiples of 2^-16 below 3: exact
    fine = (digits * phase[PHASE_DIGITS:]).sum(-2)
    turns = (coarse - torch.round(coarse)) + fine
    angles = (turns - torch.round(turns)) * (2 * math.pi)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x; cos/sin broadcast over x's head axes.

    x: [..., dim]; cos/sin: [..., rope_dim/2] already shaped to broadcast against x[..., :rope_dim/2].
    """
    half = cos.shape[-1]
    rd = 2 * half
    rot = f32(x[..., -rd:])
    even, odd = rot[..., 0::2], rot[..., 1::2]
    if inverse:
        sin = -sin
    out_even = even * cos - odd * sin
    out_odd = even * sin + odd * cos
    rotated = cast(torch.stack((out_even, out_odd), dim=-1).flatten(-2), x.dtype)
    return torch.cat((x[..., :-rd], rotated), dim=-1)


class Rotary(nn.Module):
    """Frequencies for one layer kind; `cos_sin(pos)` gives the tables for positions pos."""

    def __init__(self, rope_dim: int, theta: float, yarn: dict | None):
        super().__init__()
        self._args = (rope_dim, theta, yarn)
        # equal keys, equal tables (StepShared.rope_tables shares them between layers)
        self.key = (rope_dim, theta, None if yarn is None else tuple(sorted(yarn.items())))
        self.register_buffer("phase", rope_phase(self.freqs), persistent=False)

    @property
    def freqs(self) -> torch.Tensor:
        """The fp64 frequencies (the spec; `phase` holds them as the angles use them)."""
        return rope_frequencies(*self._args)

    def _apply(self, fn, recurse: bool = True):
        """Keep the phase fp32 through a model-wide `.to(dtype)`, which converts every floating
        buffer: rounded to bf16, the phase would put the angles off by radians within a few
        thousand positions. Recomputed from the fp64 frequencies, since converted values have
        lost their precision."""
        out = super()._apply(fn, recurse)
        if self.phase.dtype != torch.float32:
            self.phase = rope_phase(self.freqs).to(self.phase.device)
        return out

    def cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(pos, self.phase)
