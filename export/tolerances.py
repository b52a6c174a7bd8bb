"""The one table of tolerances (PIPELINE.md §7). tests/tolerances.py re-exports it so tests and
the graph checks (Polygraphy) read the same numbers.

MODEL: fp32 end-to-end paths computing the same maths in another order (chunking, caching,
exported graphs): logits and hidden values of O(1) after up to 40 layers of reassociation.
OP_FP32: fp32 single ops in another order (fused vs op-by-op mHC).
Kernel checks use `kernel_bound`: error(kernel, fp32 reference) <= 2 * error(reference run in the
kernel's dtype, fp32 reference) + the dtype's rounding floor. NaN never passes.
Low-precision graphs (bf16 bundles, export/accuracy_lowp.py) take that rule over a run of model
steps (`steps_verdict`), errors being `relative_error`s.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    against the model in float32 within twice the bf16 reference's own plus the floor, over a run
    of steps: `steps_verdict`), on ONNX Runtime's CUDA provider since the CPU provider has no bf16
    kernels (export/accuracy_lowp.py, which scripts/check_accuracy.py runs for bf16 bundles)."""
    if dtype != torch.float32:
        raise ValueError(f"fixed graph tolerances are defined for float32 bundles, not {dtype}: a "
                         f"{dtype} bundle is checked by the low-precision rule on a GPU; export the "
                         "model in float32 to check its graphs here")
    return dict(MODEL)


def relative_error(out: torch.Tensor, truth: torch.Tensor) -> float:
    """||out - truth|| / ||truth|| over truth's finite entries, in float64; inf where out has a
    NaN or its infinities differ from truth's, so such an output never passes a bound."""
    out, truth = out.detach().double().cpu(), truth.detach().double().cpu()
    inf = torch.isinf(truth)
    if torch.isnan(out).any() or not torch.equal(torch.isinf(out), inf):
        return float("inf")
    if not torch.equal(out[inf], truth[inf]):  # infinities of the wrong sign
        return float("inf")
    fin = ~inf
    return float((out[fin] - truth[fin]).norm() / truth[fin].norm().clamp_min(1e-30))


@dataclass(frozen=True)
class StepsVerdict:
    """The kernel rule over a run of model steps, for one output (see `steps_verdict`)."""

    median: float  # the run's median error over the steps
    reference_median: float  # the reference's in the low precision
    bound: float  # kernel_bound of the reference's median
    flips: int  # the run's steps past the bound
    reference_flips: int

    @property
    def passed(self) -> bool:
        return self.median <= self.bound and self.flips <= 2 * self.reference_flips + 1


def steps_verdict(pairs: list[tuple[float, float]], dtype: torch.dtype) -> StepsVerdict:
    """`pairs`: per step, (the run's error, the low-precision reference's error), both against
    truth. Discrete choices (MoE routing, index top-k) flip at some steps in a low-precision run,
    in the run and the reference at different steps, so steps are not paired: the run's median
    must be within kernel_bound of the reference's median (a systematic error fails this), and
    its flips, the steps past that bound, at most twice the reference's plus one. A NaN error
    fails (NaN never passes)."""
    if not pairs:
        raise ValueError("steps_verdict needs at least one step")
    ours, theirs = torch.tensor(pairs, dtype=torch.float64).unbind(1)
    if torch.isnan(ours).any():
        return StepsVerdict(float("nan"), theirs.median().item(), 0.0, len(pairs), 0)
    bound = kernel_bound(theirs.median().item(), dtype)
    return StepsVerdict(ours.median().item(), theirs.median().item(), bound,
                        int((ours > bound).sum()), int((theirs > bound).sum()))
