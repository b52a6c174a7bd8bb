"""The warp-specialized Gluon attention (plugins/csa2_sparse_attention/gluon_batch.py) compiled
for sm_90 on the CPU: what its GPU tests rely on, checked on any machine. Gluon kernels have no
interpreter form, so CI cannot run it; it can check that it builds as designed. The compile runs
in a subprocess: this session imports the kernels under the Triton interpreter, which cannot
compile."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton.experimental.gluon", reason="needs Triton with Gluon (3.5+)")


COMPILE = """
import json, sys
import torch
from dsflash.plugins.csa2_sparse_attention.gluon_batch import compile_sm90
split, dim, dtype, out = sys.argv[1] == "1", int(sys.argv[2]), getattr(torch, sys.argv[3]), sys.argv[4]
keys, stages, pdl, normed = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "1", sys.argv[8] == "1"
c = compile_sm90(split, dim, dtype, block_keys=keys, stages=stages, pdl=pdl, normed=normed)
open(out + ".ptx", "w").write(c.asm["ptx"])
json.dump({"num_warps": c.metadata.num_warps, "shared": c.metadata.shared}, open(out + ".json", "w"))
"""


@pytest.mark.slow
@pytest.mark.parametrize("split,dim,dtype,keys,stages,pdl,normed", [
    (True, 512, "bfloat16", 64, 2, True, False), (False, 512, "bfloat16", 64, 2, False, False),
    (True, 256, "float16", 64, 2, False, False), (False, 64, "float16", 64, 2, True, False),
    (True, 64, "bfloat16", 64, 2, False, False),
    # GLUON_KB / GLUON_STAGES: 32-key blocks in 3 and 4 stages at the released sizes
    (False, 512, "bfloat16", 32, 4, False, False), (True, 512, "bfloat16", 32, 3, False, False),
    # NORMED_PARTS: the split form's 16-bit partials, each divided by its sum
    (True, 512, "bfloat16", 64, 2, True, True), (True, 256, "float16", 32, 4, False, True)])
def test_gluon_attention_builds_as_designed(tmp_path, split, dim, dtype, keys, stages, pdl, normed):
    import torch

    from dsflash.plugins.csa2_sparse_attention.kernel import SM90_SHARED_BYTES, gluon_shared_bytes
    from dsflash.plugins.pdl import memory_before_wait

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "kernel"
    argv = ["1" if split else "0", str(dim), dtype, str(out), str(keys), str(stages), "1" if pdl else "0",
            "1" if normed else "0"]
    run = subprocess.run([sys.executable, "-c", COMPILE, *argv], env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    meta = json.loads((tmp_path / "kernel.json").read_text())
    ptx = (tmp_path / "kernel.ptx").read_text()
    assert meta["num_warps"] == 12  # 8 accumulating + the softmax warpgroup
    assert meta["shared"] <= SM90_SHARED_BYTES
    # the launcher's count (which refuses settings over the limit) holds what the compile takes
    counted = gluon_shared_bytes(64, dim, getattr(torch, dtype).itemsize, keys, stages)
    # (the count allows 1 KB of compiler scratch; the split form leaves out the 0.5 KB of statistics)
    assert counted - 2048 <= meta["shared"] <= counted
    assert ".maxnreg 168" in ptx
    # the logits once, `keys` wide, 16 dims a step; p V in halves of the dims per warpgroup, 16
    # keys a step
    wide = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", ptx)
    assert wide.count(str(keys)) == dim // 16 and wide.count(str(dim // 2)) == keys // 16
    # every accumulating thread arrives on a stage's barrier when its copies land
    assert "cp.async.mbarrier.arrive.noinc.shared.b64" in ptx
    assert len(re.findall(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], 256;", ptx)) == stages
    # the partitions' barriers are named ones of their own warps (a CTA-wide bar.sync 0 would hang)
    assert re.search(r"bar\.sync \t0, 256;", ptx) and re.search(r"bar\.sync \t\d+, 128;", ptx)
    # PDL (the JIT launch's build under {"PDL": True}; TensorRT's has none): one wait, in the default warps'
    # prologue, ahead of every global memory access in the PTX; the softmax warps' partition
    # starts at a named barrier (bar 1) that the default warps reach after it
    # (gluon_batch._wait_for_earlier_grids)
    assert ptx.count("griddepcontrol.wait") == ptx.count("griddepcontrol.launch_dependents") == int(pdl)
    if pdl:
        wait = ptx.index("griddepcontrol.wait")
        assert not memory_before_wait(ptx) and ptx.index("barrier.sync \t1;") > wait
    if split and not normed:  # the fp32 partial leaves straight from the accumulator, 8 bytes a store
        assert ptx.count("st.global.v2.b32") == 64 * dim // 256 // 2
    else:  # the finished rows (or the normed 16-bit partials) leave through shared memory in 16-byte vectors
        assert "st.global.v4" in ptx and "stmatrix" in ptx and "st.global.v2.b32" not in ptx
