"""One declaration per custom op (PIPELINE.md §4). It feeds the torch.library op and its fake,
the ONNX translation (domain trt.plugins), the ONNX Runtime CPU op and the schema test.
TensorRT registration (trt.py) and the Triton kernels read the same declaration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

DOMAIN = "trt.plugins"
TORCH_NAMESPACE = "dsflash"
PORT_DTYPES = {"float": torch.float32, "fp32": torch.float32, "int64": torch.int64, "bool": torch.bool,
               "uint8": torch.uint8, "int8": torch.int8}
ATTR_KINDS = {"int": "int", "float": "float", "ints": "int[]", "floats": "float[]"}


@dataclass(frozen=True)
class Port:
    name: str
    dtype: str  # "float" (the model's float dtype), "fp32" (always), "int64", "bool", "uint8", "int8"


@dataclass(frozen=True)
class Attr:
    name: str
    kind: str  # "int", "float", "ints" or "floats"


@dataclass(frozen=True)
class OpDecl:
    name: str                     # ONNX / TensorRT op type, e.g. "EngramHashGather"
    torch_name: str               # op name in the dsflash torch.library namespace
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    attrs: tuple[Attr, ...]
    reference: Callable           # reference(*inputs, **attrs) -> tensor or tuple (fp32 maths)
    shape_fn: Callable            # shape_fn(*input_shapes, **attrs) -> list of output shapes
    version: str = "1"

    def schema(self) -> str:
        """torch.library schema: tensors, then keyword-less attributes in declaration order."""
        args = [f"Tensor {p.name}" for p in self.inputs]
        args += [f"{ATTR_KINDS[a.kind]} {a.name}" for a in self.attrs]
        outs = ", ".join("Tensor" for _ in self.outputs)
        ret = outs if len(self.outputs) == 1 else f"({outs})"
        return f"({', '.join(args)}) -> {ret}"

    def check_attrs(self, attrs: dict) -> None:
        names = [a.name for a in self.attrs]
        if sorted(attrs) != sorted(names):
            raise ValueError(f"{self.name} takes attributes {names}, got {sorted(attrs)}")
