"""ONNX Runtime CPU ops for MhcBoundary and its split form (MhcBoundaryPartials, MhcBoundaryFinish)
in plugin-flavor graphs (onnxruntime-extensions Python ops computing the references, fp32), used
by tests and Polygraphy checks of plugin graphs."""

from __future__ import annotations

from dsflash.plugins.mhc_boundary.decl import DECL, FINISH_DECL, PARTIALS_DECL
from dsflash.plugins.ort_ops import register_pyop


def register() -> None:
    for decl in (DECL, PARTIALS_DECL, FINISH_DECL):
        register_pyop(decl)
