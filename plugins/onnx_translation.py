"""ONNX schema and translation of the custom ops (PIPELINE.md §4).

Each torch.ops.dsflash op becomes one node of domain trt.plugins with attributes
plugin_namespace (= the domain) and plugin_version, the form TensorRT's ONNX parser hands to a
registered plugin. The schema registered with onnx from the declaration lets onnx.checker and
shape inference see the node's inputs, outputs, attributes and types.
"""

from __future__ import annotations

import inspect

import torch

from dsflash.plugins.declaration import DOMAIN, OpDecl

_PORT_TYPES = {"float": ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]),
               "fp32": ("tensor(float)", None), "int64": ("tensor(int64)", None),
               "bool": ("tensor(bool)", None), "uint8": ("tensor(uint8)", None),
               "int8": ("tensor(int8)", None)}


def onnx_schema(decl: OpDecl):
    from onnx.defs import OpSchema

    kinds = {"int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT,
             "ints": OpSchema.AttrType.INTS, "floats": OpSchema.AttrType.FLOATS}

    def params(ports):
        return [OpSchema.FormalParameter(p.name, _PORT_TYPES[p.dtype][0]) for p in ports]

    attrs = [OpSchema.Attribute(a.name, kinds[a.kind], a.name) for a in decl.attrs]
    attrs += [OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING, "plugin namespace"),
              OpSchema.Attribute("plugin_version", OpSchema.AttrType.STRING, "plugin version")]
    return OpSchema(decl.name, DOMAIN, 1, doc=decl.reference.__doc__ or decl.name,
                    inputs=params(decl.inputs), outputs=params(decl.outputs),
                    type_constraints=[("T", _PORT_TYPES["float"][1], "float type")],
                    attributes=attrs)


def register_onnx_schemas() -> None:
    import onnx.defs

    from dsflash.plugins.registry import DECLS

    for decl in DECLS:
        if not onnx.defs.has(decl.name, DOMAIN):
            onnx.defs.register_schema(onnx_schema(decl))


def _translation(decl: OpDecl):
    import onnx.defs
    from onnxscript import values

    op = values.Op(values.Opset(DOMAIN, 1), decl.name, onnx.defs.get_schema(decl.name, 1, DOMAIN))
    n_in = len(decl.inputs)

    def translate(*args):
        inputs, attr_values = args[:n_in], args[n_in:]
        attrs = {a.name: (list(v) if a.kind in ("ints", "floats") else v)
                 for a, v in zip(decl.attrs, attr_values)}
        return op(*inputs, plugin_namespace=DOMAIN, plugin_version=decl.version, **attrs)

    params = [inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in decl.inputs]
    params += [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for a in decl.attrs]
    translate.__signature__ = inspect.Signature(params)
    translate.__name__ = decl.name
    return translate


def plugin_translation_table() -> dict:
    from dsflash.plugins.registry import DECLS
    from dsflash.plugins.torch_ops import register_torch_ops

    register_torch_ops()
    register_onnx_schemas()
    return {getattr(torch.ops.dsflash, d.torch_name).default: _translation(d) for d in DECLS}
