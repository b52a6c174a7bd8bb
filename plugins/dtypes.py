"""Dtype helpers that emit nothing when no conversion is needed (an fp32 model traced for export
otherwise carries hundreds of no-op casts into the graph)."""

from __future__ import annotations

import torch


def f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)
