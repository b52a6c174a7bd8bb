"""The ahead-of-time step of the TensorRT plugins (Triton -> PTX for sm_90 with launch
parameters) for every kernel of a config. It runs in a subprocess: the test session imports the
kernels under the Triton interpreter, which cannot compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_aot_kernels_for_tiny(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, str(ROOT / "scripts" / "aot_kernels.py"), "--config", "tiny",
                    "--dtype", "bf16", "--out", str(tmp_path)], check=True, env=env, timeout=300)
    index = json.loads((tmp_path / "kernels.json").read_text())
    assert sorted(index) == ["Csa2IndexScore", "Csa2SparseAttention", "EngramHashGather_layer1",
                             "EngramHashGather_layer3", "MhcBoundary"]
    for name, k in index.items():
        ptx = (tmp_path / f"{name}.ptx").read_text()
        assert ".target sm_90" in ptx and f".entry {k['entry']}(" in ptx, name
        assert k["block_x"] == 32 * k["num_warps"]
        assert 0 <= k["shared_mem"] <= 227 * 1024, f"{name}: {k['shared_mem']} B of shared memory"
        # TensorRT passes exactly the declared parameters; Triton appends two scratch pointers
        # after them, which these kernels never touch.
        assert k["params"] - k["declared"] == 2 and k["global_scratch"] == 0, name
    # attributes are compile-time constants: the two Engram layers' primes differ, so their PTX does
    ptx1, ptx3 = ((tmp_path / f"EngramHashGather_layer{i}.ptx").read_text() for i in (1, 3))
    assert ptx1 != ptx3
