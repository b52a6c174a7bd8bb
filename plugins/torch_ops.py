"""torch.library custom ops `torch.ops.dsflash.*` from the declarations: the CPU/CUDA
implementation is the reference, the fake implementation comes from the declared shape function.
Registration is idempotent (the dispatcher is process-wide)."""

from __future__ import annotations

import torch

from dsflash.plugins.declaration import PORT_DTYPES, TORCH_NAMESPACE, OpDecl


def is_registered(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def fake_outputs(decl: OpDecl, inputs, attrs: dict):
    """Empty outputs of the declared shapes and dtypes: a "float" port takes the dtype of the
    first "float" input (the model's dtype), the others their fixed dtype."""
    float_dtype = next(t.dtype for t, p in zip(inputs, decl.inputs) if p.dtype == "float")
    shapes = decl.shape_fn(*(t.shape for t in inputs), **attrs)
    outs = [inputs[0].new_empty(s, dtype=float_dtype if p.dtype == "float" else PORT_DTYPES[p.dtype])
            for s, p in zip(shapes, decl.outputs)]
    return outs[0] if len(outs) == 1 else tuple(outs)


def _register(decl: OpDecl) -> None:
    qualname = f"{TORCH_NAMESPACE}::{decl.torch_name}"
    torch.library.define(qualname, decl.schema())
    n_in = len(decl.inputs)

    def split(args):
        return args[:n_in], {a.name: v for a, v in zip(decl.attrs, args[n_in:])}

    def impl(*args):
        inputs, attrs = split(args)
        out = decl.reference(*inputs, **attrs)
        return out

    def fake(*args):
        return fake_outputs(decl, *split(args))

    torch.library.impl(qualname, "CompositeExplicitAutograd")(impl)
    torch.library.register_fake(qualname)(fake)


def register_torch_ops() -> None:
    from dsflash.plugins.registry import DECLS

    for decl in DECLS:
        if not is_registered(TORCH_NAMESPACE, decl.torch_name):
            _register(decl)
