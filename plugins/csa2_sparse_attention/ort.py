"""ONNX Runtime CPU ops for Csa2SparseAttention, its split form (Csa2SparseAttentionSplit,
Csa2AttentionCombine) and kv_qat's entry decode (Csa2EntriesFp4) in plugin-flavor graphs
(onnxruntime-extensions Python ops computing the references, fp32), used by tests and Polygraphy
checks of plugin graphs."""

from __future__ import annotations

from dsflash.plugins.csa2_sparse_attention.decl import COMBINE_DECL, DECL, ENTRIES_FP4_DECL, SPLIT_DECL
from dsflash.plugins.ort_ops import register_pyop


def register() -> None:
    for decl in (DECL, SPLIT_DECL, COMBINE_DECL, ENTRIES_FP4_DECL):
        register_pyop(decl)
