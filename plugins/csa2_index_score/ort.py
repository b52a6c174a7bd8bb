"""ONNX Runtime CPU ops for Csa2IndexScore and Csa2IndexScoreFp4 in plugin-flavor graphs
(onnxruntime-extensions Python ops computing the reference, fp32), used by tests and Polygraphy
checks of plugin graphs."""

from __future__ import annotations

from dsflash.plugins.csa2_index_score.decl import DECL, FP4_DECL
from dsflash.plugins.ort_ops import register_pyop


def register() -> None:
    register_pyop(DECL)
    register_pyop(FP4_DECL)
