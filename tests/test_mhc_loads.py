"""MhcBoundary's channel loop must pipeline tiles only: per-row constants loaded inside it became
4-byte asynchronous copies into shared memory, most of the loop's copies, and cost a fifth of the
kernel's time on the H200 (docs/benchmarks.md, session 7). The TTGIR check runs in a subprocess
(the test session imports the kernels under the Triton interpreter, which cannot compile); the
TTGIR scanner is tested here directly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[1]

# shortened lines of a real listing (the layouts and shared-memory types cut)
TTGIR = """
    %y_1 = ttg.async_copy_global_to_local %y_0, %y_9 mask %m other %c : tensor<64x16x!tt.ptr<bf16>, #b>
    %post_2 = ttg.async_copy_global_to_local %post_105, %post_195 mask %m : tensor<64x!tt.ptr<f32>, #s>
    %x = tt.load %ptrs : tensor<64x16x!tt.ptr<bf16>, #blocked>
    %fn_3 = ttg.async_copy_global_to_local %fn_0, %fn_9 : tensor<32x16x!tt.ptr<f32>, #blocked4>
"""


def test_pipelined_copies_reads_shapes_and_types_of_async_copies_only():
    from dsflash.plugins.aot import pipelined_copies

    assert pipelined_copies(TTGIR) == [((64, 16), "bf16"), ((64,), "f32"), ((32, 16), "f32")]
    assert pipelined_copies("%x = tt.load %p : tensor<64x!tt.ptr<f32>>") == []


@pytest.mark.slow
def test_mhc_boundary_pipelines_tiles_not_row_vectors():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_mhc_loads.py")], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr.count("0 row vectors, 0 recomputed operands") == 3, run.stderr[-2000:]


def test_operand_loads_reads_dot_operand_loads_only():
    from dsflash.plugins.aot import operand_loads

    # shortened lines of a real listing (the memory descriptors and parents cut)
    listing = """
      %nf = ttg.local_load %a : !m -> tensor<64x32xf32, #ttg.dot_op<{opIdx = 0, parent = #mma}>>
      %y = ttg.local_load %b token %t : !m -> tensor<64x32xbf16, #blocked1>
      %r = ttg.local_load %c token %t : !m -> tensor<64x32xbf16, #ttg.dot_op<{opIdx = 0, kWidth = 2}>>
    """
    assert operand_loads(listing) == [((64, 32), "f32", 0), ((64, 32), "bf16", 0)]
