"""Tests read tolerances from the one table (dsflash.export.tolerances, PIPELINE.md §7)."""

from __future__ import annotations

import torch

from dsflash.export.tolerances import (  # noqa: F401
    MODEL,
    OP_FP32,
    ROUNDING_FLOOR,
    SINKHORN_SUM,
    StepsVerdict,
    kernel_bound,
    relative_error,
    steps_verdict,
)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: dict, what: str = "") -> None:
    if torch.isnan(actual).any():
        raise AssertionError(f"{what}: NaN in result")
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")
