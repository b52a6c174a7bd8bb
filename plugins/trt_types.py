"""TensorRT dtype -> torch dtype, for the trt.py registrations and TrtEngine. Takes the imported
module so the full `tensorrt` and `tensorrt_lean` share one table."""

from __future__ import annotations

import torch


def io_types(decl, float_types: str) -> str:
    """A tensorrt.plugin AutoTuneCombination type string from a declaration: its inputs then its
    outputs, the model-dtype ports as `float_types` (e.g. "BF16|FP16"), the fp32 ones as FP32, so
    the plugin accepts exactly what the exported graph holds."""
    names = {"fp32": "FP32", "int64": "INT64", "bool": "BOOL", "uint8": "UINT8", "int8": "INT8",
             "float": float_types}
    return ", ".join(names[p.dtype] for p in (*decl.inputs, *decl.outputs))


def torch_dtypes(trt) -> dict:
    t = trt.DataType
    return {t.FLOAT: torch.float32, t.HALF: torch.float16, t.BF16: torch.bfloat16, t.INT64: torch.int64,
            t.INT32: torch.int32, t.BOOL: torch.bool, t.UINT8: torch.uint8, t.INT8: torch.int8}
