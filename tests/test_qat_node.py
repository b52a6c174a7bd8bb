"""The kv_qat round-trips as one traced node each while exporting (plugins/qat_round/node.py): the
reference's results eagerly, one node in the trace, and ONNX Runtime running the node's ONNX form
(onnx_form.py) bit for bit as PyTorch runs the reference, over tests/test_quant.py's hard values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsflash.model import quant
from dsflash.plugins.qat_round.node import qat_translation_table
from dsflash.plugins.registry import QAT_ROUND_TRIPS, OpSet
from test_quant import hard_values


class QatSite(nn.Module):
    """ops.qat on x in `dtype` (fp32 graph inputs and value outputs: ONNX Runtime's numpy feeds
    hold no bfloat16)."""

    def __init__(self, ops: OpSet, name: str, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.ops, self.name, self.dtype = ops, name, dtype

    def forward(self, x):
        out = self.ops.qat(self.name, x.to(self.dtype))
        return out if isinstance(out, tuple) else out.float()


def _inputs(gen, dtype: torch.dtype) -> torch.Tensor:
    """[rows, 3, 64]: the hard values (exact powers, e4m3 and e2m1 midpoints and their neighbours,
    zeros, the largest values), blocks of one scale over 2^-140 .. 2^100, and unit normals."""
    hard = hard_values(gen)
    hard = hard[: hard.numel() // 192 * 192].reshape(-1, 3, 64).clamp(-1e30, 1e30)
    scaled = torch.randn(30, 3, 64, generator=gen)
    scaled = scaled * torch.exp2(torch.randint(-140, 100, (30, 3, 2, 1), generator=gen).float()
                                 ).expand(30, 3, 2, 32).flatten(-2)
    zeros = torch.zeros(2, 3, 64)
    zeros[1, :, 7] = -0.0
    x = torch.cat([hard, scaled, zeros, torch.randn(20, 3, 64, generator=gen) * 3])
    return x.to(dtype)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("name", QAT_ROUND_TRIPS)
def test_the_node_runs_the_reference_and_traces_as_one_op(gen, name):
    x = _inputs(gen, torch.float32)[:40]
    ops = OpSet("reference", qat_node=True)
    for got, want in zip(_as_tuple(ops.qat(name, x)), _as_tuple(getattr(quant, name)(x)), strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    traced = torch.export.export(QatSite(ops, name), (x,)).graph
    dtype_ops = (torch.ops.aten.to.dtype, torch.ops.aten._assert_tensor_metadata.default)  # fp32: no-ops
    calls = [n.target for n in traced.nodes
             if n.op == "call_function" and "getitem" not in str(n.target) and n.target not in dtype_ops]
    assert calls == [getattr(torch.ops.dsflash_std, name).default]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", QAT_ROUND_TRIPS)
def test_onnx_runtime_runs_the_node_bit_for_bit(gen, name, dtype):
    """The node's ONNX form against the reference eagerly, every output: values in the input's
    dtype (bf16 rides as fp32 through the node and is cast back), codes and scales as stored."""
    ort = pytest.importorskip("onnxruntime")
    x = _inputs(gen, dtype).float()
    site = QatSite(OpSet("reference", qat_node=True), name, dtype)
    program = torch.onnx.export(site, (x[:7],), None, dynamo=True, optimize=False, verbose=False,
                                dynamic_shapes=({0: torch.export.Dim.AUTO},),
                                custom_translation_table=qat_translation_table())
    types = {n.op_type for n in program.model_proto.graph.node}
    assert not any("dsflash" in n.domain for n in program.model_proto.graph.node), types
    session = ort.InferenceSession(program.model_proto.SerializeToString())
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    want = _as_tuple(QatSite(OpSet("reference"), name, dtype)(x))  # the reference's ops eagerly
    for g, w in zip(got, want, strict=True):
        assert torch.equal(torch.from_numpy(g), w), name


def test_the_log2_guess_is_settled_one_off_either_way():
    """Every fp32-normal binade's power, its neighbours and a midpoint, with the guess one below,
    exact and one above (ONNX Runtime's Log never misses here; another runtime's may): the settled
    exponent is frexp's, run by onnxscript's eager evaluator."""
    np = pytest.importorskip("numpy")
    from dsflash.plugins.qat_round import onnx_form

    p = torch.exp2(torch.arange(-125, 127).float())
    v = torch.cat([p, torch.nextafter(p, torch.zeros(())), torch.nextafter(p, p * 2), p * 1.5])
    want = (torch.frexp(v)[1] - 1).float()
    for off in (-1.0, 0.0, 1.0):
        guess = (want + off).clamp(-126, 127).numpy()
        got = onnx_form.settle_log2(v.numpy(), guess.astype(np.float32), -126, 127)
        assert torch.equal(torch.from_numpy(np.asarray(got.value)), want), off


@pytest.mark.parametrize("name", QAT_ROUND_TRIPS)
def test_a_last_dim_off_the_block_is_refused_while_tracing(name):
    """The trace sees only the node's fake: it refuses what the reference refuses, naming the
    dim and the block, instead of an ONNX Reshape failing at run time."""
    site = QatSite(OpSet("reference", qat_node=True), name)
    with pytest.raises(ValueError, match=r"last dim 40 is not a multiple of the quantisation block (32|16)"):
        torch.export.export(site, (torch.randn(3, 40),))
