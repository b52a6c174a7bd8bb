"""Programmatic dependent launch (plugins/pdl.py): a PDL kernel must not touch global memory
before griddepcontrol.wait, or it reads what the kernel before may still be writing. The PTX
check runs in a subprocess (the test session imports the kernels under the Triton interpreter,
which cannot compile); the launch-side switch and the PTX scanner are tested here directly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[1]

PTX = """.visible .entry k(
{
\tld.param.b64 \t%rd1, [k_param_0];
\t@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
\tatom.global.gpu.acq_rel.add.u32 \t%r5, [%rd2], 1;
\tgriddepcontrol.wait; // dummy %r6
\tst.global.b32 \t[%rd3], %r5;
}"""


def test_memory_before_wait_finds_loads_stores_and_atomics_only_before_the_wait():
    from dsflash.plugins.pdl import memory_before_wait

    assert memory_before_wait(PTX) == ["ld.global.v4.b32", "atom.global.gpu.acq_rel.add.u32"]
    no_wait = PTX.replace("griddepcontrol.wait; // dummy %r6", "")
    assert memory_before_wait(no_wait) == ["ld.global.v4.b32", "atom.global.gpu.acq_rel.add.u32",
                                           "st.global.b32"]
    first = PTX.split("\t@%p1")[0] + "\tgriddepcontrol.wait;\n" + "\t@%p1" + PTX.split("\t@%p1")[1]
    assert memory_before_wait(first) == []  # parameter loads before the wait are fine
    # an L2 hint from inline asm sits mid-line, inside braces
    hint = PTX.replace("\tgriddepcontrol.wait;", "\t{ .reg .pred p; @p prefetch.global.L2 [%rd4]; }\n\tgriddepcontrol.wait;")
    assert memory_before_wait(hint)[-1] == "prefetch.global.L2"


def test_pdl_is_off_where_the_gpu_cannot_do_it():
    from dsflash.plugins.pdl import pdl_launch_args

    assert pdl_launch_args(torch.device("cpu")) == {"PDL": False}
    assert pdl_launch_args(torch.device("cpu"), {"PDL": True}) == {"PDL": False}


@pytest.mark.slow
def test_pdl_kernels_wait_before_touching_memory():
    """Every PDL kernel compiled for sm_90: the wait comes before its first global memory
    instruction, and the PDL-off build (TensorRT's) has no griddepcontrol at all."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_pdl_ptx.py")], env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    from dsflash.plugins.pdl import pdl_kernel_specs

    assert run.stderr.count("before the wait") == len(pdl_kernel_specs()) == 28, run.stderr[-2000:]
