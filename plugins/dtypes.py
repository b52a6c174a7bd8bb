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


def exact_pow2(e: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """2^e in fp32 for integer e in [lo, hi] (within [-149, 128]; 128 gives inf), exactly.

    Eagerly (and under torch.compile): the fp32 bit pattern, 3-4 kernels; no table, whose
    constant would be a host-to-device copy per call (CUDA-graph capture refuses it). While
    exporting to ONNX, which has no bitcast: a Gather from a table of the exact powers (an
    initializer of hi - lo + 1 floats; the runtime holds it on the device), not Pow/Exp, whose
    results some runtimes round. tests/test_quant.py checks the first against ldexp, and the
    exported graph against the eager values bit for bit."""
    if not -149 <= lo <= hi <= 128:  # fp32 holds no other power of two (128: inf)
        raise ValueError(f"exact_pow2: exponent range [{lo}, {hi}] must lie within [-149, 128]")
    if not torch.compiler.is_exporting():
        e = e.to(torch.int32)
        normal = ((e + 127).clamp(1, 255) << 23).view(torch.float32)  # exponent field e + 127
        if lo >= -126:  # no subnormal result: the round-trips' scales and steps
            return normal
        low = ((e + 191).clamp(1, 254) << 23).view(torch.float32) * 2.0**-64  # subnormal results
        return torch.where(e >= -126, normal, low)
    # one Gather from the exact powers (an initializer of hi - lo + 1 values): a product per set
    # bit of e - lo (the form before, 7 nodes per bit) made a tiny kv_qat decode step 19K nodes
    # (embedding: a plain Gather on axis 0; indexing exports as GatherND with transposes)
    table = torch.tensor([[fp32_pow2(i)] for i in range(lo, hi + 1)], dtype=torch.float32, device=e.device)
    return torch.nn.functional.embedding((e.long() - lo).clamp(0, hi - lo), table).squeeze(-1)


def fp32_pow2(exponent: int) -> float:
    """2^exponent as fp32 holds it: inf from 128 (Python's float holds 2^128; its fp32 cast is
    inf by the rounding rule, made explicit here)."""
    return 2.0**exponent if exponent < 128 else float("inf")


def e2m1_magnitude(code: torch.Tensor) -> torch.Tensor:
    """E2M1_GRID[code & 7] in fp32 for int64 codes, by arithmetic (no constant tensor, as
    exact_pow2): codes 0-3 are 0, .5, 1, 1.5; 4-7 are 2, 3, 4, 6 = 2^(code // 2 - 1) * (1 + odd / 2)."""
    m = (code % 8).float()
    odd = m - 2 * torch.floor(m * 0.5)
    high = torch.where(m >= 6, 4.0, 2.0) * (1 + 0.5 * odd)
    return torch.where(m < 4, m * 0.5, high)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """FP4 codes two per byte (low nibble first, bit 3 the sign) [..., C] -> their e2m1 grid
    values [..., 2C] in fp32. Arithmetic on int64 rather than bit operations on uint8 (which ONNX
    export mistypes) and no constant tensors (the reasons of exact_pow2's eager form)."""
    byte = codes.long()
    nib = torch.stack([byte % 16, byte // 16], dim=-1).flatten(-2)
    mag = e2m1_magnitude(nib)
    return torch.where(nib >= 8, -mag, mag)


def e4m3_value(bits: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn bits (0-126 as uint8 or int64: no sign, no NaN) -> the value in fp32, by
    arithmetic (as e2m1_values): exponent field E = bits // 8, mantissa m = bits % 8; (8 + m)
    2^(E - 10) for E >= 1, m 2^-9 for the subnormals."""
    b = bits.long()
    e = b // 8
    m = (b - e * 8).float()
    normal = (8 + m) * exact_pow2(e - 10, -10, 5)
    return torch.where(e > 0, normal, m * 2.0**-9)
