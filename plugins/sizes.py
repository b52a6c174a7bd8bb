"""Size arithmetic shared by the split forms' plans (csa2_sparse_attention/splits.py,
mhc_boundary/splits.py), which run on ints, on torch's SymInts while tracing, and on TensorRT's
shape expressions inside a plugin's shape function.

`TORCH_SIZES` serves ints and SymInts (no guard on a dynamic size); `trt_sizes(trtp)` serves
TensorRT's shape expressions, which have +, -, *, // only with the expression on the left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from dsflash.plugins.aot import cdiv_expr as cdiv

H200_SMS = 132  # streaming multiprocessors of the H200 the exported split attributes are tuned for


class SizeOps(NamedTuple):
    cdiv: Callable
    min: Callable
    max: Callable


TORCH_SIZES = SizeOps(cdiv, torch.sym_min, torch.sym_max)


def trt_sizes(trtp) -> SizeOps:
    """tensorrt.plugin's cdiv / min / max, which refuse two ints (python's then)."""
    def pick(sym, py):
        return lambda a, b: py(a, b) if isinstance(a, int) and isinstance(b, int) else sym(a, b)

    return SizeOps(pick(trtp.cdiv, cdiv), pick(trtp.min, min), pick(trtp.max, max))
