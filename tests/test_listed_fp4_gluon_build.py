"""The listed pool's FP4 index kernel in Gluon (plugins/csa2_index_score/listed_fp4_gluon.py)
compiled for sm_90 on the CPU: the schedule its design rests on, checked on any machine (Gluon
kernels have no interpreter form; tests/test_listed_fp4_gluon_gpu.py runs it on a GPU). The
compile runs in a subprocess: this session imports the kernels under the Triton interpreter,
which cannot compile."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.experimental.gluon", reason="needs Triton with Gluon (3.5+)")

COMPILE = """
import json, sys
from dsflash.plugins.csa2_index_score.listed_fp4_gluon import compile_sm90
block_n, stages, heads, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
maxnreg = None if sys.argv[5] == "none" else int(sys.argv[5])
c = compile_sm90(block_n=block_n, stages=stages, heads=heads, maxnreg=maxnreg)
open(out + ".ptx", "w").write(c.asm["ptx"])
open(out + ".cubin", "wb").write(c.asm["cubin"])
json.dump({"num_warps": c.metadata.num_warps, "shared": c.metadata.shared}, open(out + ".json", "w"))
"""


def _resources(cubin: Path) -> dict:
    """Registers and stack (spills) per thread of the compiled kernel, from cuobjdump (shipped
    with Triton's NVIDIA backend)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    text = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", text)}


@pytest.mark.slow
@pytest.mark.parametrize("block_n,stages,heads,maxnreg", [
    (64, 6, 32, "none"), (64, 6, 32, "80"), (128, 4, 32, "128"), (64, 3, 16, "none"), (64, 4, 64, "none")])
def test_gluon_listed_fp4_builds_as_designed(tmp_path, block_n, stages, heads, maxnreg):
    from dsflash.plugins.csa2_sparse_attention.kernel import SM90_SHARED_BYTES

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "kernel"
    argv = [str(block_n), str(stages), str(heads), str(out), maxnreg]
    run = subprocess.run([sys.executable, "-c", COMPILE, *argv], env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    meta = json.loads((tmp_path / "kernel.json").read_text())
    ptx = (tmp_path / "kernel.ptx").read_text()
    assert meta["num_warps"] == 4
    assert meta["shared"] <= SM90_SHARED_BYTES
    # the stages: codes 64 B, an exponent word and an id per slot; the query tiles hi and lo
    assert meta["shared"] >= stages * block_n * (64 + 4 + 4) + 2 * heads * 128
    # per scale group the hi and lo products (m64 x heads x k32, FP8, keys from registers) in the
    # loop with a lo part, hi only in the loop without; two 64-row products per 128-entry block
    dots = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{heads}k32\.f32\.e4m3\.e4m3", ptx)
    assert len(dots) == (block_n // 64) * 4 * (2 + 1)
    # one group's products stay in flight while the previous group's are scaled
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx))
    assert {"2", "1"} <= waits, waits
    # a block waits for its own copies only: STAGES - 2 groups may stay in flight
    assert re.search(rf"cp\.async\.wait_group\s+{stages - 2};", ptx)
    res = _resources(tmp_path / "kernel.cubin")
    if maxnreg != "none":
        assert f".maxnreg {maxnreg}" in ptx and res["REG"] <= int(maxnreg)
    if (block_n, maxnreg) != (128, "128"):  # 128-entry blocks spill under the 128-register cap
        assert res["STACK"] == 0, res
