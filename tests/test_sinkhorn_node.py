"""Sinkhorn as one traced node while exporting (plugins/mhc_boundary/sinkhorn_node.py): the same
numbers eagerly, one node in the trace, the same ONNX Runtime results as the traced ops, and the
export's OpSet set up for it and restored."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from dsflash.export.onnx_export import TRACE_FORMS, ExportOptions, graph_forms
from dsflash.plugins.mhc_boundary.reference import sinkhorn
from dsflash.plugins.mhc_boundary.sinkhorn_node import sinkhorn_translation_table
from dsflash.plugins.registry import OpSet
from conftest import random_ids
from tolerances import OP_FP32, assert_close

EPS = 1e-6


class SinkhornSite(nn.Module):
    def __init__(self, ops: OpSet, iters: int):
        super().__init__()
        self.ops, self.iters = ops, iters

    def forward(self, logits_BSCC):
        return self.ops.sinkhorn(logits_BSCC, self.iters, EPS)


class CountSinkhornNodes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.dsflash_std.sinkhorn.default
        return func(*args, **(kwargs or {}))


def _onnx(site: SinkhornSite, example: torch.Tensor):
    dynamic = ({0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO},)
    program = torch.onnx.export(site, (example,), None, dynamo=True, input_names=["logits"],
                                output_names=["comb"], dynamic_shapes=dynamic, optimize=False,
                                custom_translation_table=sinkhorn_translation_table(), verbose=False)
    return program.model_proto


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_the_node_runs_the_reference_and_traces_as_one_op(gen, iters):
    logits = torch.randn(2, 3, 4, 4, generator=gen) * 3
    ops = OpSet("reference", sinkhorn_node=True)
    assert torch.equal(ops.sinkhorn(logits, iters, EPS), sinkhorn(logits, iters, EPS))
    traced = torch.export.export(SinkhornSite(ops, iters), (logits,)).graph
    calls = [n.target for n in traced.nodes if n.op == "call_function"]
    assert calls == [torch.ops.dsflash_std.sinkhorn.default]


@pytest.mark.parametrize("iters", [1, 3, 20])
def test_the_onnx_translation_computes_what_the_traced_ops_do(gen, iters):
    """Both graphs on ONNX Runtime bit for bit, at the traced batch and at others (dynamic axes),
    and both within OP_FP32 of the PyTorch reference; the same count of each op type."""
    import onnxruntime as ort

    example = torch.randn(2, 3, 4, 4, generator=gen)
    protos = {node: _onnx(SinkhornSite(OpSet("reference", sinkhorn_node=node), iters), example)
              for node in (True, False)}
    for proto in protos.values():
        reduce_sums = sum(n.op_type == "ReduceSum" for n in proto.graph.node)
        assert reduce_sums == 2 * iters - 1
        assert sum(n.op_type == "Softmax" for n in proto.graph.node) == 1
    sessions = {node: ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"])
                for node, p in protos.items()}
    for shape in ((2, 3, 4, 4), (1, 7, 4, 4), (5, 1, 4, 4)):
        logits = torch.randn(*shape, generator=gen) * 4
        outs = {node: s.run(None, {"logits": logits.numpy()})[0] for node, s in sessions.items()}
        assert np.array_equal(outs[True], outs[False]), shape
        assert_close(torch.from_numpy(outs[True]), sinkhorn(logits, iters, EPS), OP_FP32, f"{shape}")


def test_a_model_run_with_the_node_takes_it_at_every_site(tiny_model, gen):
    """Every coefficient site (two a layer: the op-by-op ones of layer 0 and the Engram layers,
    the reference boundaries elsewhere) takes the node, and the logits stay the same bits."""
    ids = random_ids(gen, 2, 9, tiny_model.cfg.vocab_size)
    ops = tiny_model.ops
    assert not ops.sinkhorn_node
    with torch.no_grad():
        expected = tiny_model(ids)
        ops.sinkhorn_node = True
        try:
            with CountSinkhornNodes() as count:
                got = tiny_model(ids)
        finally:
            ops.sinkhorn_node = False
    assert count.calls == 2 * tiny_model.cfg.num_hidden_layers
    assert torch.equal(got, expected)


@pytest.mark.parametrize("graph,flavor", [("decoder_step", "plugin"), ("encoder_prefill", "portable")])
def test_graph_forms_set_the_export_forms_and_restore_them(graph, flavor):
    ops = OpSet("reference", pool_form="list", entry_form="auto")
    before = {name: getattr(ops, name) for name in TRACE_FORMS}
    with graph_forms(ops, graph, flavor, ExportOptions(decode_attention="single")):
        assert ops.sinkhorn_node and ops.qat_node
        assert ops.backend == ("custom_op" if flavor == "plugin" else "reference")
        assert ops.split_mhc == (graph == "decoder_step" and flavor == "plugin")
        assert not ops.split_attention  # "single" keeps one attention node
        assert ops.entry_form == ("selected" if graph == "decoder_step" else "all")
    assert {name: getattr(ops, name) for name in TRACE_FORMS} == before
    with pytest.raises(RuntimeError, match="inside"), graph_forms(ops, graph, flavor):
        assert ops.split_attention == (graph == "decoder_step" and flavor == "plugin")
        raise RuntimeError("inside")
    assert {name: getattr(ops, name) for name in TRACE_FORMS} == before

