"""ONNX Runtime CPU op for Csa2SparseAttention in plugin-flavor graphs (an onnxruntime-extensions Python op
computing the reference, fp32), used by tests and Polygraphy checks of plugin graphs."""

from __future__ import annotations

from dsflash.plugins.csa2_sparse_attention.decl import DECL
from dsflash.plugins.ort_ops import register_pyop


def register() -> None:
    register_pyop(DECL)
