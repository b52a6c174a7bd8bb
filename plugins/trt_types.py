"""TensorRT dtype -> torch dtype, for the trt.py registrations and TrtEngine. Takes the imported
module so the full `tensorrt` and `tensorrt_lean` share one table."""

from __future__ import annotations

import torch


def torch_dtypes(trt) -> dict:
    t = trt.DataType
    return {t.FLOAT: torch.float32, t.HALF: torch.float16, t.BF16: torch.bfloat16, t.INT64: torch.int64,
            t.INT32: torch.int32, t.BOOL: torch.bool}
