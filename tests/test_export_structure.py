"""Structure exports (export/structure.py, scripts/export.py --structure): graphs built on the
meta device, written without weights and checked against the state contract."""

import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from dsflash.export import structure
from dsflash.export.bundle import BundleError

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "export.py"


def test_a_structure_export_is_checked_against_the_contract(tiny_cfg, tmp_path, monkeypatch):
    seen = []
    reports = structure.write_structures(tiny_cfg, tmp_path, ("plugin",), ("encoder_prefill",),
                                         progress=seen.append)
    assert seen == reports and len(reports) == 1
    r = reports[0]
    assert (r.graph, r.flavor, r.path) == ("encoder_prefill", "plugin",
                                           tmp_path / "encoder_prefill.plugin.onnx")
    proto = onnx.load(str(r.path), load_external_data=False)
    assert not proto.graph.initializer and r.nodes == len(proto.graph.node) > 0
    assert r.custom_nodes["MhcBoundary"] > 0 and r.custom_nodes["EngramHashGather"] == 2
    # a contract the graph does not follow: the check names the first difference
    want = structure.contract_io(tiny_cfg, "encoder_prefill")
    renamed = {**want, "inputs": [{**want["inputs"][0], "name": "token_ids"}, *want["inputs"][1:]]}
    monkeypatch.setattr(structure, "contract_io", lambda cfg, graph: renamed)
    with pytest.raises(BundleError, match="does not match the contract.*token_ids"):
        structure.check_structure(tiny_cfg, "encoder_prefill", "plugin", r.path)


@pytest.mark.parametrize("kwargs, match", [({"workers": 0}, "workers must be >= 1, got 0"),
                                           ({"graphs": ("decode",)}, "unknown graphs")])
def test_write_structures_refuses_bad_arguments_before_exporting(tiny_cfg, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        structure.write_structures(tiny_cfg, tmp_path / "out", ("plugin",), **kwargs)
    assert not (tmp_path / "out").exists()


def test_the_flash_preset_exports_only_its_structure():
    run = subprocess.run([sys.executable, str(SCRIPT), "--config", "flash", "--out", "unused"],
                         check=False, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "--config flash needs --structure" in run.stderr
