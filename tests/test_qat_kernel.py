"""The kv_qat round-trips as Triton kernels (plugins/qat_round) against their references in
model/quant.py, bit for bit: values where exponents and rounding go wrong (test_quant.hard_values)
in blocks of every scale, in fp32, bf16 and fp16, over block counts that cross the kernel's
programs. Without CUDA the kernels run in the Triton interpreter (conftest), as in CI."""

from __future__ import annotations

import pytest
import torch
from test_quant import hard_values

from dsflash.plugins.launch import interpreting
from dsflash.plugins.qat_round import reference

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROUND_TRIPS = ("fp8_e4m3_qat", "fp4_pow2_qat", "fp4_pow2_pack", "fp4_e4m3scale_pack")


def _blocks_of_every_scale(gen, block: int) -> torch.Tensor:
    """hard_values in rows of `block` channels, each block scaled by its own power of two (so
    amax, and with it the scale, spans the range), plus an all-zero block and a saturating one."""
    v = hard_values(gen).clamp(-1e30, 1e30)
    v = v[: v.numel() // (4 * block) * 4 * block].view(-1, 4, block)
    scale = torch.exp2(torch.randint(-40, 40, (v.shape[0], 4, 1), generator=gen).float())
    v = (v * scale).clamp(-3e38, 3e38)
    v[0, 0] = 0.0
    v[0, 1] = 1e6
    return v.flatten(1)


@pytest.mark.parametrize("name", ROUND_TRIPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_kernel_is_bit_exact(gen, name, dtype):
    from dsflash.plugins.qat_round import kernel

    block = 16 if name == "fp4_e4m3scale_pack" else 32
    x = _blocks_of_every_scale(gen, block)
    if dtype != torch.float32:  # in range of the dtype (fp16: 65504)
        x = (x / x.abs().amax(-1, keepdim=True).clamp_min(1e-30) * 1000).to(dtype)
    if dtype == torch.bfloat16 and interpreting():
        # the interpreter converts bf16 subnormals to fp32 wrongly (triton 3.6: 6.52e-39 -> 1.29e-39);
        # the GPU keeps them, and runs them
        x = torch.where(x.abs() < torch.finfo(dtype).tiny, torch.zeros_like(x), x)
    want = getattr(reference, name)(x)
    got = getattr(kernel, name)(x.to(DEVICE))
    want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.cpu(), w), f"{name} {dtype}: {(g.cpu() != w).sum()} of {w.numel()} differ"


def test_round_trip_kernel_shapes_and_bad_input(gen):
    """Leading dims kept ([B, S, H, D] queries), an empty input, and a last dim the block does not
    divide refused with the values named."""
    from dsflash.plugins.qat_round import kernel

    x = torch.randn(2, 3, 5, 64, generator=gen)
    assert torch.equal(kernel.fp4_pow2_qat(x.to(DEVICE)).cpu(), reference.fp4_pow2_qat(x))
    codes, exps = kernel.fp4_pow2_pack(x.to(DEVICE))
    assert codes.shape == (2, 3, 5, 32) and exps.shape == (2, 3, 5, 2)
    assert kernel.fp8_e4m3_qat(torch.empty(0, 32, device=DEVICE)).shape == (0, 32)
    with pytest.raises(ValueError, match="last dim 40 is not a multiple of the quantisation block 32"):
        kernel.fp8_e4m3_qat(torch.randn(2, 40, device=DEVICE))
    with pytest.raises(ValueError, match="x has dtype torch.int64"):
        kernel.fp4_pow2_qat(torch.ones(2, 32, dtype=torch.int64, device=DEVICE))


def test_opset_runs_the_round_trips_by_name(gen):
    """OpSet.qat: the kernels on the Triton backend, the references elsewhere, the same bits; an
    unknown name is refused."""
    from dsflash.plugins.registry import OpSet

    x = torch.randn(3, 128, generator=gen)
    for name in ROUND_TRIPS:
        want = OpSet("reference").qat(name, x)
        got = OpSet("triton").qat(name, x.to(DEVICE))
        want, got = (want, got) if isinstance(want, tuple) else ((want,), (got,))
        assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want, strict=True)), name
    with pytest.raises(ValueError, match="unknown kv_qat round-trip 'fp8_qat'"):
        OpSet("reference").qat("fp8_qat", x)
