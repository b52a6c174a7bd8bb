"""How deep Triton's software pipeline runs the sparse attention's key loops
(scripts/check_attention_pipeline.py, compiled for sm_90 in a subprocess: the test session imports
the kernels under the Triton interpreter, which cannot compile) and the TTGIR reader it uses."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[1]

TTGIR = """
    %a = ttg.async_copy_global_to_local %p, %s : tensor<32x!tt.ptr<i64>, #blocked> -> <32xi64>
    %l:3 = scf.for %i = %c0 to %n step %c1 iter_args(%x = %a) -> (tensor<64xf32>) {
      %w = ttg.async_wait %x, %y {num = 2 : i32} loc(#loc1)
      %d = ttng.warp_group_dot %q, %k, %acc {inputPrecision = 0 : i32, isAsync = true}
      scf.yield %w : tensor<64xf32>
    } loc(#loc2)
    %after = ttg.async_wait {num = 0 : i32} loc(#loc3)
    %m:2 = scf.for %j = %c0 to %n step %c1 iter_args(%z = %a) -> (tensor<64xf32>) {
      %v = ttg.async_wait %z {num = 0 : i32} loc(#loc4)
      scf.yield %v : tensor<64xf32>
    } loc(#loc5)
"""


def test_loop_async_waits_reads_each_loops_waits_only():
    from dsflash.plugins.aot import loop_async_waits

    assert loop_async_waits(TTGIR) == [[2], [0]]  # the wait between the loops belongs to neither
    assert loop_async_waits("%x = tt.load %p") == []


@pytest.mark.slow
def test_ids_ahead_keep_row_copies_in_flight():
    """With the ids a step ahead, the selected loop waits with num_stages - 2 row copies in flight
    (2 at 4 stages, 6 at 8); loaded in the step, it waits for all of them (0)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_attention_pipeline.py")], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"32 keys, 4 stages +copies in flight at the wait: selected loop 0,", run.stderr)
    assert re.search(r"16 keys, 8 stages, ids ahead +copies in flight at the wait: selected loop 6,", run.stderr)
