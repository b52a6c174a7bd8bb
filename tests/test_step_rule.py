"""The tolerance rule over a run of model steps (kernel_checks.assert_steps_within_rule), which the
bf16 graph check on the GPU uses (tests/test_ort_cuda.py), and the bf16 element type its
IOBinding needs (the CUDA sessions' memory reuse: tests/test_runtime.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import assert_steps_within_rule

from tolerances import kernel_bound, relative_error

BF16 = torch.bfloat16


def _run(gen, steps: int, level: float, flips: list[int], scale: float = 1.0):
    """Per-step errors around `level` (a few percent spread), with discrete flips (errors of ~20x
    the level, as the H100 run showed) at the given steps."""
    errs = level * scale * (1 + 0.05 * torch.rand(steps, generator=gen, dtype=torch.float64))
    errs[flips] = 20 * level
    return errs.tolist()


def test_the_rule_accepts_flips_at_different_steps_in_each_run(gen):
    ours = _run(gen, 32, 0.007, [6, 7, 9])
    theirs = _run(gen, 32, 0.007, [2, 4, 5, 12])
    verdict = assert_steps_within_rule(list(zip(ours, theirs)), BF16, "logits")
    assert (verdict.flips, verdict.reference_flips) == (3, 4) and verdict.passed


def test_the_rule_rejects_a_systematic_error(gen):
    theirs = _run(gen, 32, 0.007, [3])
    ours = _run(gen, 32, 0.007, [3], scale=2.0 + 2 * 2**-8 / 0.007)  # past 2x + floor
    assert ours[0] > kernel_bound(sorted(theirs)[16], BF16)
    with pytest.raises(AssertionError, match="logits: median error"):
        assert_steps_within_rule(list(zip(ours, theirs)), BF16, "logits")


def test_the_rule_rejects_more_than_twice_the_references_flips_plus_one(gen):
    theirs = _run(gen, 32, 0.007, [5])
    assert_steps_within_rule(list(zip(_run(gen, 32, 0.007, [1, 8, 20]), theirs)), BF16, "kv")
    with pytest.raises(AssertionError, match="4 flips"):
        assert_steps_within_rule(list(zip(_run(gen, 32, 0.007, [1, 8, 20, 30]), theirs)), BF16, "kv")


def test_the_rule_rejects_nan_and_relative_error_never_passes_one():
    with pytest.raises(AssertionError, match="kv: median error nan"):
        assert_steps_within_rule([(0.01, 0.01), (float("nan"), 0.01), (0.01, 0.01)], BF16, "kv")
    truth = torch.tensor([1.0, -2.0, float("-inf")])
    assert relative_error(truth.bfloat16(), truth) == 0.0
    assert relative_error(torch.tensor([1.0, -2.0, float("nan")]), truth) == float("inf")
    assert relative_error(torch.tensor([1.0, -2.0, float("inf")]), truth) == float("inf")  # wrong sign
    assert relative_error(torch.tensor([1.0, float("inf"), float("-inf")]), truth) == float("inf")
    assert relative_error(torch.tensor([1.0, -2.5, float("-inf")]), truth) == pytest.approx(0.5 / 5**0.5)


def test_iobinding_names_bf16_by_its_onnx_element_type():
    """numpy has no bfloat16, so the CUDA engine binds every tensor by ONNX's enum (onnxruntime
    >= 1.20); a dtype without one is refused by name."""
    from onnx import TensorProto

    from dsflash.runtime.engine import _element_type

    assert _element_type(torch.bfloat16) == TensorProto.BFLOAT16
    assert _element_type(torch.float32) == TensorProto.FLOAT
    assert _element_type(torch.int64) == TensorProto.INT64
    with pytest.raises(ValueError, match="torch.complex64"):
        _element_type(torch.complex64)
