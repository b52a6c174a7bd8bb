"""Every plugin's tensorrt.plugin registration (shape function, autotune, aot_impl), executed
against stand-ins for tensorrt and tensorrt.plugin (tests/trt_standin.py): no TensorRT builder
installs on the project's machines, and until this test nothing ran these closures."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")


@pytest.mark.slow
def test_trt_registrations_against_a_stand_in():
    """Output shapes equal the declarations' shape functions, output types follow the ports,
    a type combination accepts a bf16 graph's types, and every tactic's aot_impl compiles and
    launches with int32 extras (a subprocess: the AOT compile cannot run under the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("trt_standin.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert run.returncode == 0, run.stdout[-1000:] + run.stderr[-3000:]
    assert run.stdout.count(" OK") == 10, run.stdout
    assert run.stdout.count("symbolic launch == int launch") == 2, run.stdout
    # the split attention node's Gluon tactic (bf16, 64 x 512) and the combine's chunked tactic
    assert "Csa2SparseAttentionSplit: shapes, types and 3 tactic(s) OK" in run.stdout, run.stdout
    assert "Csa2AttentionCombine: shapes, types and 2 tactic(s) OK" in run.stdout, run.stdout
