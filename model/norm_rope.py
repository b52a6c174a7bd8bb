"""RMSNorm and rotary embeddings (ARCHITECTURE.md Part B §5).

RMSNorm: y = w * x * rsqrt(mean(x^2) + eps), computed in fp32 and rounded once.
RoPE: interleaved pairs (2i, 2i+1) of the trailing `rope_dim` channels as complex numbers;
plain theta on window-only layers, compress theta + YaRN on compressed layers. cos/sin have unit
magnitude (no mscale), so the inverse rotation is the conjugate.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsflash.model.dtypes import cast, f32


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


def rope_cos_sin(pos: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape pos.shape + [rope_dim/2] in fp32 (angles formed in fp64)."""
    angles = pos.to(torch.float64).unsqueeze(-1) * freqs.to(pos.device)
    return angles.cos().float(), angles.sin().float()


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
        self.register_buffer("freqs", rope_frequencies(*self._args), persistent=False)

    def _apply(self, fn, recurse: bool = True):
        """Keep the frequencies fp64 through a model-wide `.to(dtype)`, which converts every
        floating buffer: rounded to bf16, the flash preset's frequencies put the angles off by up
        to 1.8 rad at position 4K and 57 rad at 128K (theta 1e4; fp32: 1.4e-3 rad at 128K).
        Recomputed, since the converted values have lost their precision."""
        out = super()._apply(fn, recurse)
        if self.freqs.dtype != torch.float64:
            self.freqs = rope_frequencies(*self._args).to(self.freqs.device)
        return out

    def cos_sin(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(pos, self.freqs)
