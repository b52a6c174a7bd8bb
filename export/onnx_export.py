"""Export the two graphs to ONNX in the plugin and portable flavors (PIPELINE.md §2, §4).

`torch.onnx.export(dynamo=True)` on `GraphModule`, with dynamic batch, rows and cache capacity
(N<m> entry axes) from the contract. Plugin flavor: the model's OpSet runs torch.library ops that
translate to trt.plugins nodes. Portable: the same model with the reference maths, standard
ONNX ops only. Stable sorts (top-k ties to the lower index) become ONNX TopK, whose spec breaks
ties the same way.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from dsflash.export.contract import graph_inputs
from dsflash.export.graphs import GraphModule
from dsflash.model.model import DSFlashModel
from dsflash.model.moe import MOE_EXPORT_DISPATCH, export_form
from dsflash.plugins.registry import OpSet

log = logging.getLogger(__name__)
FLAVORS = ("plugin", "portable")
# decoder_step's attention in the plugin flavor: "split" (Csa2SparseAttentionSplit +
# Csa2AttentionCombine: one decode row's keys spread over the GPU) or "single" (one
# Csa2SparseAttention node, unsplit: no fp32 partials to write and merge, which wins at large
# decode batches; H100, scripts/bench_aot.py --attention-decode, 2026-12-06, both forms' best
# tactics: batch 32 23.4 us split against 27.5 single, 48 30.0 against 26.8, 64 36.2 against
# 29.4, 128 59.1 against 44.8, 1 7.9 against 27.0). encoder_prefill's rows fill the GPU alone:
# one node in either.
DECODE_ATTENTION_FORMS = ("split", "single")
# the measured crossover (H100, above): the split pair wins up to 32 rows, one node from 48
SPLIT_ATTENTION_UP_TO_ROWS, SINGLE_ATTENTION_FROM_ROWS = 32, 48
# decoder_step's routed experts (model/moe.py): "dense" runs every expert on every row (weight 0
# where not routed), "gathered" gathers each row's k experts from the stacks (a copy of k/E of
# them per row). Gathered moves fewer bytes while rows < E / (3k): it reads, writes and reads its
# copies (flash: 21.3 rows of 384 experts, k = 6; one flash layer on an H100,
# scripts/bench_moe_dispatch.py, 2026-12-06: 19.5x dense's speed at 1 row, 1.46x at 16, 0.76x at
# 32). It holds rows x k x 3 expert matrices at once (flash, bf16: 425 MB a row); dense holds no
# copy. Standard ops either way: a grouped-expert plugin reading the stacks in place is not
# written. encoder_prefill stays dense.
DECODE_MOE_FORMS = MOE_EXPORT_DISPATCH
# Example sizes for tracing: all distinct and > 1 so no dimension is specialised or equated.
EXAMPLE_BATCH, EXAMPLE_ROWS, EXAMPLE_CAPACITY = 2, 5, 40


def _sort_stable(self, stable=None, dim: int = -1, descending: bool = False):
    from onnxscript import opset18 as op

    k = op.Shape(self, start=dim, end=dim + 1 if dim != -1 else None)
    return op.TopK(self, k, axis=dim, largest=1 if descending else 0, sorted=1)


def translation_table(flavor: str) -> dict:
    from dsflash.plugins.mhc_boundary.sinkhorn_node import sinkhorn_translation_table
    from dsflash.plugins.qat_round.node import qat_translation_table

    table = {torch.ops.aten.sort.stable: _sort_stable}
    table |= sinkhorn_translation_table() | qat_translation_table()
    if flavor == "plugin":
        from dsflash.plugins.onnx_translation import plugin_translation_table

        table.update(plugin_translation_table())
    return table


@dataclass(frozen=True)
class ExportOptions:
    """How decoder_step is exported; a bundle's manifest records them as its export_options.
    decode_attention: its attention nodes in the plugin flavor (DECODE_ATTENTION_FORMS);
    decode_moe: its routed experts' dispatch (DECODE_MOE_FORMS). A ValueError naming the value
    and the forms for any other."""
    decode_attention: str = "split"
    decode_moe: str = "dense"

    def __post_init__(self) -> None:
        if self.decode_attention not in DECODE_ATTENTION_FORMS:
            raise ValueError(f"unknown decode attention form {self.decode_attention!r}; forms: "
                             f"{DECODE_ATTENTION_FORMS}")
        if self.decode_moe not in DECODE_MOE_FORMS:
            raise ValueError(f"unknown decode MoE form {self.decode_moe!r}; forms: {DECODE_MOE_FORMS}")

    def as_dict(self) -> dict:
        return {"decode_attention": self.decode_attention, "decode_moe": self.decode_moe}


def export_graph(model: DSFlashModel, graph: str, flavor: str, options: ExportOptions = ExportOptions()):
    """-> onnx.ModelProto with in-memory initializers named by the model's parameter names."""
    proto = _export_program(model, graph, flavor, options).model_proto
    _clean(proto)
    return proto


def _clean(proto) -> None:
    _strip_module_prefix(proto)
    for node in proto.graph.node:  # stack traces per node triple the file size; keep names only
        del node.metadata_props[:]
        node.doc_string = ""


def _export_program(model: DSFlashModel, graph: str, flavor: str, options: ExportOptions):
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r}; flavors: {FLAVORS}")
    module = GraphModule(model, graph).eval()
    cfg = model.cfg
    example = module.example_inputs(EXAMPLE_BATCH, EXAMPLE_CAPACITY, EXAMPLE_ROWS,
                                    dtype=model.embed.weight.dtype)
    # A model on the meta device exports its structure only (sizes too big to materialise here).
    example = tuple(t.to(model.embed.weight.device) for t in example)
    dynamic = tuple({axis: torch.export.Dim.AUTO for axis in t.dynamic_axes()}
                    for t in graph_inputs(cfg, graph))
    dispatch = options.decode_moe if graph == "decoder_step" else "dense"
    with torch.no_grad(), graph_forms(model.ops, graph, flavor, options), export_form(model, dispatch):
        return torch.onnx.export(
            module, example, None, dynamo=True, input_names=module.input_names,
            output_names=module.output_names, dynamic_shapes=(dynamic,), optimize=False,
            custom_translation_table=translation_table(flavor), verbose=False)


# the OpSet settings graph_forms sets for a trace (and restores)
TRACE_FORMS = ("backend", "split_attention", "split_mhc", "entry_form", "sinkhorn_node", "qat_node")


@contextmanager
def graph_forms(ops: OpSet, graph: str, flavor: str, options: ExportOptions = ExportOptions()):
    """The model's OpSet set up to trace `graph` in `flavor`, restored afterwards (also on an
    error): the plugin flavor runs the custom ops, the portable one the references."""
    previous = {name: getattr(ops, name) for name in TRACE_FORMS}
    ops.backend = "custom_op" if flavor == "plugin" else "reference"
    # decoder_step runs decode steps (one row per sequence): its attention and mHC nodes take the
    # split forms, whose key / channel splits a TensorRT plugin cannot do inside one node
    # (plugins/registry.py); the attention keeps one node where the export asks for it
    decode_plugins = flavor == "plugin" and graph == "decoder_step"
    ops.split_mhc = decode_plugins
    ops.split_attention = decode_plugins and options.decode_attention == "split"
    # kv_qat's FP4 entries: a decode step decodes the ones it selects, a prefill all of them once
    ops.entry_form = "selected" if graph == "decoder_step" else "all"
    # each Sinkhorn traced as one node, written out as its ops (mhc_boundary/sinkhorn_node.py)
    ops.sinkhorn_node = True
    # and each kv_qat round-trip (qat_round/node.py)
    ops.qat_node = True
    try:
        yield ops
    finally:
        for name, value in previous.items():
            setattr(ops, name, value)


def _strip_module_prefix(proto) -> None:
    """GraphModule holds the model as `.model`; name initializers by the checkpoint names."""
    renames = {init.name: init.name[len("model."):] for init in proto.graph.initializer
               if init.name.startswith("model.")}
    for init in proto.graph.initializer:
        init.name = renames.get(init.name, init.name)
    for node in proto.graph.node:
        for i, name in enumerate(node.input):
            if name in renames:
                node.input[i] = renames[name]


def write_shared_weights(protos: dict[str, object], out_dir: Path, weights_name: str = "weights.bin",
                         inline_below: int = 1024) -> None:
    """Move every large initializer into one external-data file, each distinct tensor once, and
    point every graph at it (the graphs of a bundle share their weights)."""
    import hashlib

    from onnx import TensorProto

    offsets: dict[tuple[str, str], tuple[int, int]] = {}
    with open(out_dir / weights_name, "wb") as f:
        for proto in protos.values():
            for init in proto.graph.initializer:
                raw = init.raw_data
                if not raw or len(raw) < inline_below:
                    continue
                key = (init.name, hashlib.sha256(raw).hexdigest())
                if key not in offsets:
                    pad = (-f.tell()) % 64  # 64-byte alignment lets runtimes map tensors directly
                    f.write(b"\0" * pad)
                    offsets[key] = (f.tell(), len(raw))
                    f.write(raw)
                offset, length = offsets[key]
                init.ClearField("raw_data")
                init.data_location = TensorProto.EXTERNAL
                del init.external_data[:]
                for k, v in (("location", weights_name), ("offset", str(offset)), ("length", str(length))):
                    entry = init.external_data.add()
                    entry.key, entry.value = k, v
    log.info("wrote %d distinct tensors to %s", len(offsets), weights_name)


def export_structure(cfg, graph: str, flavor: str, path: str | Path,
                     options: ExportOptions = ExportOptions()) -> None:
    """Export a graph of a config built on the meta device, without weights: checks that a size
    exports (and shows its graph) without materialising its parameters."""
    with torch.device("meta"):
        model = DSFlashModel(cfg).eval()
    model = model.to("meta")  # buffers made from numpy (the Engram vocab map) too
    import onnx

    _export_program(model, graph, flavor, options).save(str(path), include_initializers=False)
    proto = onnx.load(str(path))
    _clean(proto)
    onnx.save(proto, str(path))
