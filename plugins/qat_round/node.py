"""The kv_qat round-trips as one traced node each while exporting, written out as standard ONNX ops.

Why: torch.export traces each round-trip's export form op by op (model/quant.py: a log2 guess
settled by exact powers, powers gathered from tables, rounding at the value's step; ~90 ops for
one FP8 round-trip) and traces them again to decompose them. In the tiny kv_qat model's portable
decoder_step they were most of its traced ops (docs/benchmarks.md, session 45). As one
`torch.ops.dsflash_std.<name>` node the trace skips them, and the ONNX translation
(onnx_form.py) emits the same exact maths, so the graphs compute what they did, bit for bit on
ONNX Runtime (tests/test_qat_node.py).

Each node takes the fp32 input (blocks of the reference's default size along the last axis) and
gives the reference's results in fp32 (values) or its packed dtypes; OpSet.qat casts the values
back to the input's dtype, as the reference does. The model takes this form only where the export
asks for it (OpSet.qat_node); eager and compiled runs keep the Triton launch or the reference.
"""

from __future__ import annotations

import torch

from dsflash.model.quant import check_block, packed_storage
from dsflash.plugins.dtypes import cast, f32
from dsflash.plugins.qat_round import reference

NAMESPACE = "dsflash_std"


def _values_fake(x):
    check_block(x, 32)
    return torch.empty_like(x, dtype=torch.float32)


def _packed_fake(side_dtype: torch.dtype, block: int):
    return lambda x: packed_storage(x, block, side_dtype)


# name -> (schema's outputs, fake); the names are OpSet.qat's (QAT_ROUND_TRIPS), the ONNX
# translations onnx_form.<name>_onnx (imported only when exporting: the model imports no onnx)
NODES = {
    "fp8_e4m3_qat": ("Tensor", _values_fake),
    "fp4_pow2_qat": ("Tensor", _values_fake),
    "fp4_pow2_pack": ("(Tensor, Tensor)", _packed_fake(torch.int8, 32)),
    "fp4_e4m3scale_pack": ("(Tensor, Tensor)", _packed_fake(torch.uint8, 16)),
}


def register_qat_ops() -> None:
    """Define torch.ops.dsflash_std.<round-trip> (once per process): the reference as its
    implementation."""
    from dsflash.plugins.torch_ops import is_registered

    for name, (outputs, fake) in NODES.items():
        if is_registered(NAMESPACE, name):
            continue
        qualname = f"{NAMESPACE}::{name}"
        torch.library.define(qualname, f"(Tensor x) -> {outputs}")
        torch.library.impl(qualname, "CompositeExplicitAutograd")(getattr(reference, name))
        torch.library.register_fake(qualname)(fake)


def qat_node(name: str, x: torch.Tensor):
    """reference.<name>(x) as one op (register_qat_ops first): values in x's dtype, packs as the
    reference packs them."""
    out = getattr(torch.ops.dsflash_std, name)(f32(x))
    return out if isinstance(out, tuple) else cast(out, x.dtype)


def qat_translation_table() -> dict:
    """The ops' entries for torch.onnx.export's custom_translation_table (both flavors)."""
    from dsflash.plugins.qat_round import onnx_form

    register_qat_ops()
    ops = torch.ops.dsflash_std
    return {getattr(ops, name).default: getattr(onnx_form, f"{name}_onnx") for name in NODES}
