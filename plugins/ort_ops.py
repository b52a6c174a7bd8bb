"""ONNX Runtime CPU implementations of the custom ops, to run plugin-flavor graphs in tests and
Polygraphy checks (onnxruntime-extensions Python ops; the maths is the reference).

onnxruntime-extensions serves Python ops from its own domain and takes only int, float and
string attributes, so `ort_plugin_model` rewrites each trt.plugins node for it: domain
ai.onnx.contrib, list attributes as JSON strings, the TensorRT-only attributes dropped. Only
fp32 graphs are supported here (the reference runs fp32 maths); others are refused.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from dsflash.plugins.declaration import DOMAIN, OpDecl

ORT_DOMAIN = "ai.onnx.contrib"


def _pyop_types():
    from onnxruntime_extensions import PyCustomOpDef

    return {"float": PyCustomOpDef.dt_float, "fp32": PyCustomOpDef.dt_float, "int64": PyCustomOpDef.dt_int64,
            "bool": PyCustomOpDef.dt_bool, "uint8": PyCustomOpDef.dt_uint8,
            "int8": PyCustomOpDef.dt_int8}, {"int": PyCustomOpDef.dt_int64,
                                             "float": PyCustomOpDef.dt_float,
                                             "ints": PyCustomOpDef.dt_string,
                                             "floats": PyCustomOpDef.dt_string}


def _ort_kernel(decl: OpDecl):
    def run(*arrays, **attrs):
        parsed = {a.name: json.loads(attrs[a.name]) if a.kind in ("ints", "floats") else attrs[a.name]
                  for a in decl.attrs}
        with torch.no_grad():
            out = decl.reference(*(torch.from_numpy(np.ascontiguousarray(x)) for x in arrays), **parsed)
        outs = out if isinstance(out, tuple) else (out,)
        res = tuple(o.contiguous().numpy() for o in outs)
        return res if len(res) > 1 else res[0]

    return run


def register_pyop(decl: OpDecl) -> None:
    """Register one op with onnxruntime-extensions, once per process (it keeps a process-wide
    table). Each op's ort.py calls this with its declaration."""
    from onnxruntime_extensions import onnx_op
    from onnxruntime_extensions._ocos import Opdef

    if decl.name in {op.op_type for op in Opdef._odlist.values()}:
        return
    ports, kinds = _pyop_types()
    onnx_op(op_type=decl.name, inputs=[ports[p.dtype] for p in decl.inputs],
            outputs=[ports[p.dtype] for p in decl.outputs],
            attrs={a.name: kinds[a.kind] for a in decl.attrs})(_ort_kernel(decl))


def register_ort_ops() -> None:
    """Every op's ONNX Runtime CPU implementation (plugins/<op>/ort.py)."""
    from dsflash.plugins.csa2_index_score import ort as index_ort
    from dsflash.plugins.csa2_sparse_attention import ort as attn_ort
    from dsflash.plugins.engram_hash_gather import ort as engram_ort
    from dsflash.plugins.mhc_boundary import ort as mhc_ort

    for op in (engram_ort, index_ort, attn_ort, mhc_ort):
        op.register()


def ort_plugin_model(model):
    """A copy of a plugin-flavor ModelProto that onnxruntime-extensions can run."""
    import onnx
    from onnx import helper

    from dsflash.plugins.registry import decl_by_name

    model = onnx.ModelProto.FromString(model.SerializeToString())
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        decl = decl_by_name(node.op_type)
        kept = []
        for attr in node.attribute:
            if attr.name in ("plugin_namespace", "plugin_version"):
                continue
            value = helper.get_attribute_value(attr)
            if any(a.name == attr.name and a.kind in ("ints", "floats") for a in decl.attrs):
                attr = helper.make_attribute(attr.name, json.dumps(list(value)))
            kept.append(attr)
        del node.attribute[:]
        node.attribute.extend(kept)
        node.domain = ORT_DOMAIN
    for imp in model.opset_import:
        if imp.domain == DOMAIN:
            imp.domain = ORT_DOMAIN
    for t in list(model.graph.input) + list(model.graph.output):
        if t.type.tensor_type.elem_type in (onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16):
            raise ValueError(f"plugin graphs run under ONNX Runtime only in fp32; {t.name} is "
                             f"{onnx.TensorProto.DataType.Name(t.type.tensor_type.elem_type)}")
    return model


def ort_session_options():
    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path

    register_ort_ops()
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(get_library_path())
    return opts
