"""The `small` preset exports (structure only: built on the meta device, weights not
materialised; its fp32 weights would be 3.6 GB). One run of it in CI, about two minutes."""

import onnx
import pytest

from dsflash.export.bundle import contract_io, first_io_difference, onnx_io
from dsflash.export.onnx_export import export_structure
from dsflash.model.config import ModelConfig


@pytest.mark.slow
def test_small_decoder_step_exports(tmp_path):
    cfg = ModelConfig.preset("small")
    path = tmp_path / "decoder_step.portable.onnx"
    export_structure(cfg, "decoder_step", "portable", path)
    proto = onnx.load(str(path))
    assert first_io_difference(onnx_io(proto), contract_io(cfg, "decoder_step")) is None
    assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}
    assert sum(n.op_type == "TopK" for n in proto.graph.node) > 0
