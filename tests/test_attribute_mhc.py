"""scripts/attribute_mhc.py edits the sources of kernel.py and finish.py to build its variants:
every edit must still apply to the current kernel (else the GPU run stops at that variant), and
an edited copy must load as a module of its own with the kernel and launcher in it. CPU only;
nothing is launched."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("attribute_mhc", ROOT / "scripts" / "attribute_mhc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_variant_applies_to_the_current_kernel(tmp_path):
    script = _script()
    assert len(script.VARIANTS) >= 10
    for name, (edits, overrides, n_split) in script.VARIANTS.items():
        module = script.load_variant(name, edits, tmp_path)
        assert hasattr(module, "mhc_boundary_kernel") and hasattr(module, "MhcBoundaryLauncher"), name
        source = "".join(path.read_text() for path in module.variant_sources)
        for _old, new, _count in edits:
            assert new in source, name
        assert n_split is None or n_split >= 1


def test_an_edit_that_no_longer_matches_stops_the_run(tmp_path):
    script = _script()
    with pytest.raises(SystemExit, match="occurs 0 times"):
        script.load_variant("stale", [("this text is not in kernel.py", "x", 1)], tmp_path)
