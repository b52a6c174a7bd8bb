"""ONNX Runtime CPU ops for Csa2SparseAttention and its split form (Csa2SparseAttentionSplit,
Csa2AttentionCombine) in plugin-flavor graphs (onnxruntime-extensions Python ops computing the
references, fp32), used by tests and Polygraphy checks of plugin graphs."""

from __future__ import annotations

from dsflash.plugins.csa2_sparse_attention.decl import COMBINE_DECL, DECL, SPLIT_DECL
from dsflash.plugins.ort_ops import register_pyop


def register() -> None:
    for decl in (DECL, SPLIT_DECL, COMBINE_DECL):
        register_pyop(decl)
