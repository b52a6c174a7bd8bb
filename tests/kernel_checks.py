"""The kernel tolerance rule of PIPELINE.md §7 as a test helper:

    error(kernel, truth) <= 2 * error(reference run in the kernel's dtype, truth) + rounding floor

Errors are relative norms ||out - truth|| / ||truth|| over the finite entries; -inf entries must
match exactly and NaN never passes. `truth` is the reference evaluated in float64 (its f32()
upcasts redirected to float64); the reference "in the kernel's dtype" is the same code with the
upcasts removed and every float input cast to that dtype, i.e. what eager PyTorch would give.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from tolerances import StepsVerdict, kernel_bound, relative_error, steps_verdict

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(*ts) -> list:
    """The tensors among `ts` moved to the test device (the GPU where there is one), the rest as
    they are."""
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ts]


@contextlib.contextmanager
def _upcast_to(module_name: str, target):
    module = sys.modules[module_name]
    saved = module.f32
    module.f32 = target
    try:
        yield
    finally:
        module.f32 = saved


def _as(args, dtype):
    return [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def reference_runs(fn, args, kwargs, dtype):
    """(truth in float64, reference in `dtype`), both as tuples of CPU tensors."""
    name = fn.__module__
    with torch.no_grad():
        cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        with _upcast_to(name, lambda x: x.double()):
            truth = fn(*_as(cpu, torch.float64), **kwargs)
        with _upcast_to(name, lambda x: x):
            lowp = fn(*_as(cpu, dtype), **kwargs)
    as_tuple = (lambda o: o if isinstance(o, tuple) else (o,))
    return as_tuple(truth), as_tuple(lowp)


def rel_error(out: torch.Tensor, truth: torch.Tensor, what: str) -> float:
    out, truth = out.detach().cpu().double(), truth.double()
    assert not torch.isnan(out).any(), f"{what}: NaN in the kernel's output"
    inf_out, inf_ref = torch.isinf(out), torch.isinf(truth)
    differ = int((inf_out != inf_ref).sum())
    assert torch.equal(inf_out, inf_ref), f"{what}: infinities differ in {differ} places"
    if inf_ref.any():
        assert torch.equal(out[inf_ref], truth[inf_ref]), f"{what}: infinities of the wrong sign"
    return relative_error(out, truth)


def assert_kernel_matches(outs, fn, args, kwargs, dtype: torch.dtype, what: str) -> list[tuple[float, float]]:
    """Check each output of a kernel; returns (error, bound) per output for reports."""
    outs = outs if isinstance(outs, tuple) else (outs,)
    truth, lowp = reference_runs(fn, args, kwargs, dtype)
    report = []
    for i, (o, t, lo) in enumerate(zip(outs, truth, lowp, strict=True)):
        err = rel_error(o, t, f"{what}[{i}]")
        bound = kernel_bound(rel_error(lo, t, f"{what}[{i}] reference in {dtype}"), dtype)
        assert err <= bound, f"{what}[{i}]: error {err:.3g} > bound {bound:.3g} ({dtype})"
        report.append((err, bound))
    return report


def assert_steps_within_rule(pairs: list[tuple[float, float]], dtype: torch.dtype,
                             what: str) -> StepsVerdict:
    """The rule over a run of model steps (dsflash.export.tolerances.steps_verdict) as an
    assertion naming the output and both runs' errors."""
    verdict = steps_verdict(pairs, dtype)
    assert verdict.passed, (
        f"{what}: median error {verdict.median:.3g} and {verdict.flips} flips against the bound "
        f"{verdict.bound:.3g} (the reference in {dtype}: {verdict.reference_flips} flips); errors "
        f"{[f'{e:.3g}' for e, _ in pairs]}, reference {[f'{e:.3g}' for _, e in pairs]}")
    return verdict
