"""The one table of tolerances (PIPELINE.md §7). tests/tolerances.py re-exports it so tests and
the graph checks (Polygraphy) read the same numbers.

MODEL: fp32 end-to-end paths computing the same maths in another order (chunking, caching,
exported graphs): logits and hidden values of O(1) after up to 40 layers of reassociation.
OP_FP32: fp32 single ops in another order (fused vs op-by-op mHC).
Kernel checks use `kernel_bound`: error(kernel, fp32 reference) <= 2 * error(reference run in the
kernel's dtype, fp32 reference) + the dtype's rounding floor. NaN never passes.
"""

from __future__ import annotations

import torch

MODEL = {"rtol": 1e-5, "atol": 5e-5}
OP_FP32 = {"rtol": 1e-5, "atol": 1e-5}
# Sinkhorn after its 20 iterations: rows sum to 1 within this for unit-scale logits.
SINKHORN_SUM = 1e-3
ROUNDING_FLOOR = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def kernel_bound(err_reference_lowp: float, dtype: torch.dtype) -> float:
    return 2.0 * err_reference_lowp + ROUNDING_FLOOR[dtype]


def graph_tolerance(dtype: torch.dtype) -> dict:
    """Exported graph vs the PyTorch reference in the same dtype, for float32 bundles. A bfloat16
    bundle's graphs are held to the kernels' rule instead (`kernel_bound`: the graph's error
    against the model in float32 within twice the bf16 reference's own plus the floor), on ONNX
    Runtime's CUDA provider since the CPU provider has no bf16 kernels (tests/test_ort_cuda.py)."""
    if dtype != torch.float32:
        raise ValueError(f"fixed graph tolerances are defined for float32 bundles, not {dtype}: a "
                         f"{dtype} bundle is checked by the low-precision rule on a GPU; export the "
                         "model in float32 to check its graphs here")
    return dict(MODEL)
