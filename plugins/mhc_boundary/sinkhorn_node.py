"""Sinkhorn as one traced node while exporting, written out as the reference's standard ONNX ops.

Why: torch.export traces every op of every Sinkhorn iteration (6 ops x hc_sinkhorn_iters per
coefficient site, 20 iterations at the released sizes), then traces them again to decompose
them; in the tiny model's portable decoder_step that was 60% of the 4,592 traced ops and much
of its export time. As one `torch.ops.dsflash_std.sinkhorn` node the trace skips them, and the
ONNX translation below emits the same ops the traced form lowers to (Softmax, then ReduceSum /
Add eps / Div per normalisation, fp32), so the graph computes what it did, bit for bit on ONNX
Runtime (tests/test_sinkhorn_node.py). CPU, 2026-12-06 (docs/benchmarks.md, session 44): the
tiny portable decoder_step traces 2,704 ops instead of 4,592; the flash preset's decoder_step
structure export takes 282 s instead of 383.

The model takes this form only where the export asks for it (OpSet.sinkhorn_node); eager and
compiled runs keep the PyTorch ops, which inductor fuses.
"""

from __future__ import annotations

import torch

from dsflash.plugins.dtypes import f32
from dsflash.plugins.mhc_boundary.reference import sinkhorn

NAMESPACE = "dsflash_std"
OP_NAME = "sinkhorn"


def register_sinkhorn_op() -> None:
    """Define torch.ops.dsflash_std.sinkhorn (once per process): the reference as its
    implementation, an fp32 tensor of the logits' shape as its fake."""
    from dsflash.plugins.torch_ops import is_registered

    if is_registered(NAMESPACE, OP_NAME):
        return
    qualname = f"{NAMESPACE}::{OP_NAME}"
    torch.library.define(qualname, "(Tensor logits, int iters, float eps) -> Tensor")
    torch.library.impl(qualname, "CompositeExplicitAutograd")(sinkhorn)
    torch.library.register_fake(qualname)(
        lambda logits, iters, eps: torch.empty_like(logits, dtype=torch.float32))


def sinkhorn_node(logits_BSCC: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """reference.sinkhorn's signature and result, as one op (register_sinkhorn_op first)."""
    return torch.ops.dsflash_std.sinkhorn(f32(logits_BSCC), int(iters), float(eps))


def sinkhorn_onnx(logits, iters: int, eps: float):
    """The ONNX translation: reference.sinkhorn's ops in its order on fp32 logits (the node's
    input is f32(logits)): row softmax + eps, a column normalisation, then iters - 1 row / column
    pairs, each a ReduceSum (keepdims), + eps and a Div."""
    from onnxscript import opset18 as op

    eps_f32 = op.Constant(value_float=float(eps))
    rows, cols = op.Constant(value_ints=[-1]), op.Constant(value_ints=[-2])

    def normalise(c, axes):
        return op.Div(c, op.Add(op.ReduceSum(c, axes, keepdims=1), eps_f32))

    c = normalise(op.Add(op.Softmax(logits, axis=-1), eps_f32), cols)
    for _ in range(int(iters) - 1):
        c = normalise(normalise(c, rows), cols)
    return c


def sinkhorn_translation_table() -> dict:
    """The op's entry for torch.onnx.export's custom_translation_table (both flavors)."""
    register_sinkhorn_op()
    return {torch.ops.dsflash_std.sinkhorn.default: sinkhorn_onnx}
