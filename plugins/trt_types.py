"""TensorRT dtype to torch dtype, for the trt.py registrations (imports tensorrt)."""

from __future__ import annotations

import tensorrt as trt
import torch

TORCH_FROM_TRT = {trt.float32: torch.float32, trt.bfloat16: torch.bfloat16, trt.float16: torch.float16,
                  trt.int64: torch.int64, trt.int32: torch.int32, trt.bool: torch.bool}
