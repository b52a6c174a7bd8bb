"""The kv_qat round-trips' references. Their spec is model/quant.py, which the model calls
through OpSet.qat; kernel.py has the same signatures as one Triton launch each, and
tests/test_qat_kernel.py holds it to these bit for bit."""

from __future__ import annotations

from dsflash.model.quant import fp4_e4m3scale_pack, fp4_pow2_pack, fp4_pow2_qat, fp8_e4m3_qat

__all__ = ["fp4_e4m3scale_pack", "fp4_pow2_pack", "fp4_pow2_qat", "fp8_e4m3_qat"]
