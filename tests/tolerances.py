"""The one table of tolerances (PIPELINE.md §7). Tests import from here; nothing else picks one.

Model-level comparisons in fp32 (the same maths in a different order: chunking, caching,
exported graphs) use MODEL. Kernel-vs-reference checks use `kernel_bound`: the error of the
kernel against the fp32 reference may be at most twice the error of the reference run in the
kernel's dtype, plus the dtype's rounding floor.
"""

from __future__ import annotations

import torch

# fp32 end-to-end paths: logits / hidden values of O(1) after up to 40 layers of reassociation.
MODEL = dict(rtol=1e-5, atol=5e-5)
# fp32 single ops computed in another order (fused vs op-by-op mHC, normalise-then-project).
OP_FP32 = dict(rtol=1e-5, atol=1e-5)
# Sinkhorn: doubly stochastic to within its eps-regularised fixed point after 20 iterations.
SINKHORN_SUM = 1e-3

ROUNDING_FLOOR = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def kernel_bound(err_reference_lowp: float, dtype: torch.dtype) -> float:
    return 2.0 * err_reference_lowp + ROUNDING_FLOOR[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: dict, what: str = "") -> None:
    if torch.isnan(actual).any():
        raise AssertionError(f"{what}: NaN in result")
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")
