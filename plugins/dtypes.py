"""Dtype helpers that emit nothing when no conversion is needed (an fp32 model traced for export
otherwise carries hundreds of no-op casts into the graph)."""

from __future__ import annotations

import torch


def f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


# FP4 e2m1 magnitudes by code (bits 0-2; bit 3 is the sign): the model's QAT round-trips
# (model/quant.py) and the FP4 index keys (plugins/csa2_index_score) share this grid
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
