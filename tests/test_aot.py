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

from dsflash.plugins.ptx_launch import ptx_param_types

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_aot_kernels_for_tiny(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, str(ROOT / "scripts" / "aot_kernels.py"), "--config", "tiny",
                    "--dtype", "bf16", "--out", str(tmp_path)], check=True, env=env, timeout=300)
    index = json.loads((tmp_path / "kernels.json").read_text())
    # tiny's head_dim 32 gives the attention one tactic (DECODE retiles wide heads only)
    assert sorted(index) == ["Csa2AttentionCombine", "Csa2AttentionCombine_tactic2", "Csa2IndexScore",
                             "Csa2IndexScore_tactic2",
                             "Csa2SparseAttention", "Csa2SparseAttentionSplit",
                             "Csa2SparseAttentionSplit_tactic2",
                             "EngramHashGather_layer1", "EngramHashGather_layer3", "MhcBoundary",
                             "MhcBoundaryFinish", "MhcBoundaryFinish_tactic2", "MhcBoundaryPartials",
                             "MhcBoundaryPartials_tactic2", "MhcBoundaryPartials_tactic3",
                             "MhcBoundary_tactic2"]
    # what TensorRT passes: the input pointers, the aot_impl's extra ints, the output pointers
    trt_args = {"Csa2IndexScore": 4 + 2 + 1, "Csa2SparseAttention": 6 + 5 + 1, "EngramHashGather": 2 + 1 + 1,
                "MhcBoundary": 9 + 3 + 5, "Csa2SparseAttentionSplit": 6 + 5 + 2,
                "Csa2AttentionCombine": 4 + 1 + 1, "MhcBoundaryPartials": 6 + 3 + 4,
                "MhcBoundaryFinish": 6 + 2 + 4}
    for name, k in index.items():
        op = name.split("_")[0]
        ptx = (tmp_path / f"{name}.ptx").read_text()
        assert ".target sm_90" in ptx and f".entry {k['entry']}(" in ptx, name
        assert k["block_x"] == 32 * k["num_warps"]
        assert 0 <= k["shared_mem"] <= 227 * 1024, f"{name}: {k['shared_mem']} B of shared memory"
        assert k["declared"] == trt_args[op], f"{name} declares {k['declared']} parameters"
        # Triton appends two scratch pointers after them, which these kernels never touch
        params = ptx_param_types(ptx, k["entry"])
        assert len(params) == k["params"] == k["declared"] + 2 and k["global_scratch"] == 0, name
        assert params[-2:] == ["u64", "u64"] and k["aligned"], name
    assert index["Csa2IndexScore_tactic2"]["launch"]["BLOCKS"] == 4
    split = index["Csa2SparseAttentionSplit"]["launch"]
    assert split["BLOCK_K"] == 64 and split["num_stages"] == 1  # tiny: head_dim 32
    assert index["Csa2SparseAttentionSplit_tactic2"]["launch"]["num_stages"] == 3
    # attributes are compile-time constants: the two Engram layers' primes differ, so their PTX does
    ptx1, ptx3 = ((tmp_path / f"EngramHashGather_layer{i}.ptx").read_text() for i in (1, 3))
    assert ptx1 != ptx3


AOT_LAUNCH_CHECKS = """
import types
import pytest
import torch
from dsflash.plugins.csa2_index_score import trt as index_trt
from dsflash.plugins.csa2_sparse_attention import kernel as attn_kernel
from dsflash.plugins.csa2_sparse_attention import splits
from dsflash.plugins.csa2_sparse_attention import trt as attn_trt
from dsflash.plugins.csa2_sparse_attention import trt_split
from dsflash.plugins.engram_hash_gather import trt as engram_trt
from dsflash.plugins.sizes import trt_sizes
from dsflash.plugins.mhc_boundary import trt as mhc_trt
from dsflash.plugins.mhc_boundary import trt_split as mhc_split
# stand-ins for tensorrt.plugin's shape expressions and launch objects (tests/trt_standin.py)
from trt_standin import Expr, Params, SymIntExprs, size_functions, value

bf16 = torch.bfloat16
one = index_trt.aot_launch((2, 3, 32, 128), (2, 131075, 128), bf16, tactic=1)
assert one.grid == (6, 2049, 1) and one.extra == (3, 131075), one
two = index_trt.aot_launch((2, 3, 32, 128), (2, 131075, 128), bf16, tactic=2)
assert two.grid == (6, 257, 1) and two.kernel.num_warps == 8, two
assert index_trt.aot_launch((2, 3, 32, 128), (2, 64, 128), bf16, tactic=0).grid == (6, 1, 1)
with pytest.raises(ValueError, match="tactic 2 is not one of \\\\[1\\\\] for torch.float32 keys"):
    index_trt.aot_launch((1, 1, 8, 64), (1, 10, 64), torch.float32, tactic=2)
# kv_qat's FP4 keys (trt_fp4.py): 64 heads x 128, codes [B, N, 64], both tactics
from dsflash.plugins.csa2_index_score import trt_fp4
decode = trt_fp4.aot_launch((2, 3, 64, 128), (2, 131075, 64), bf16, tactic=1)
assert decode.grid == (6, 2049, 1) and decode.extra == (3, 131075) and decode.kernel.declared == 8, decode
mma = trt_fp4.aot_launch((2, 3, 64, 128), (2, 131075, 64), bf16, tactic=2)
assert mma.grid == (6, 513, 1) and "mma" in mma.kernel.ptx and mma.kernel.declared == 8, mma.grid
assert trt_fp4.tactics(bf16, 2) == [1] and trt_fp4.tactics(torch.float32, 64) == [1]
with pytest.raises(ValueError, match="tactic 2 is not one of \\\\[1\\\\] for torch.float32 queries"):
    trt_fp4.aot_launch((1, 1, 64, 128), (1, 10, 64), torch.float32, tactic=2)
# kv_qat's FP4 entries (trt_entries_fp4.py): 3 rows of 17 ids decoded to 512 channels, 8 rows a program
from dsflash.plugins.csa2_sparse_attention import trt_entries_fp4
ent = trt_entries_fp4.aot_launch((2, 700, 256), (2, 3, 17), bf16)
assert ent.grid == (13, 1, 1) and ent.extra == (700, 51, 102) and ent.kernel.declared == 8, ent
with pytest.raises(ValueError, match="head_dim 40 is not a multiple of 16"):
    trt_entries_fp4.aot_kernel(bf16, 40)
attn = attn_trt.aot_launch((1, 2, 64, 512), (1, 5000, 512), (1, 2, 512), (1, 130, 512), bf16, 0.04)
assert attn.grid[0] == 2 and attn.extra[:4] == (2, 5000, 130, 512), attn
block_k = attn_kernel.launch_config(64, 512, bf16)["BLOCK_K"]
assert attn.extra[4] == -(-512 // block_k) + -(-130 // block_k), attn
gather = engram_trt.aot_launch((4, 3 + 9), (1000, 256), bf16, [3, 5, 7, 9], [11] * 24, list(range(24)), 0, 8)
assert gather.grid[0] == 36 and gather.extra == (9,), gather
mhc = mhc_trt.aot_launch((2, 7, 4, 5120), bf16, 20, 1e-6, 1e-6)
assert mhc.extra == (14, 5120, 1) and mhc.grid == (1, 1, 1), mhc
few = mhc_trt.aot_launch((2, 7, 4, 5120), bf16, 20, 1e-6, 1e-6, tactic=2)
assert few.grid == (1, 1, 1) and few.kernel.shared_mem != mhc.kernel.shared_mem, few
assert mhc_trt.aot_launch((2, 70, 4, 5120), bf16, 20, 1e-6, 1e-6, tactic=2).grid == (9, 1, 1)
with pytest.raises(ValueError, match="MhcBoundary: tactic 4 is not one of"):
    mhc_trt.aot_launch((2, 7, 4, 5120), bf16, 20, 1e-6, 1e-6, tactic=4)
clustered = mhc_trt.aot_launch((2, 7, 4, 5120), bf16, 20, 1e-6, 1e-6, tactic=3)
assert clustered.grid == (8, 1, 1) and ".reqnctapercluster 8, 1, 1" in clustered.kernel.ptx, clustered.grid
assert clustered.kernel.ptx.count("barrier.cluster.arrive.release") == 2
assert mhc_trt.tactics(4, 5120, bf16) == [1, 2, 3] and mhc_trt.tactics(4, 64, bf16) == [1, 2]
with pytest.raises(ValueError, match="hidden 64 is too narrow for clusters of 8 CTAs"):
    mhc_trt.aot_launch((1, 1, 4, 64), bf16, 20, 1e-6, 1e-6, tactic=3)
assert attn_trt.tactics(bf16, 64, 512) == [1, 2, 3, 4] and attn_trt.tactics(bf16, 8, 64) == [1]
assert attn_trt.tactics(torch.float32, 64, 512) == [1, 2] and attn_trt.tactics(bf16, 40, 512) == [1, 2]
wide = attn_trt.aot_launch((1, 2, 64, 512), (1, 5000, 512), (1, 2, 512), (1, 130, 512), bf16, 0.04, tactic=2)
assert wide.kernel.num_warps == 8 and wide.extra[4] == 8 + 3, wide
# the batch form: all 64 heads in one program of 8 warps, 64-key blocks, 2 stages' shared memory
batch = attn_trt.aot_launch((2, 40, 64, 512), (2, 5000, 512), (2, 40, 512), (2, 168, 512), bf16, 0.04,
                            tactic=3)
assert batch.grid == (80, 1, 1) and batch.kernel.num_warps == 8 and batch.extra[4] == 8 + 3, batch
assert "wgmma" in batch.kernel.ptx and 128 * 1024 < batch.kernel.shared_mem <= 227 * 1024, batch.kernel
# the Gluon kernel unsplit: 12 warps, its register cap in the PTX, 64-key blocks (5 + 3 of them)
glu = attn_trt.aot_launch((2, 40, 64, 512), (2, 5000, 512), (2, 40, 300), (2, 168, 512), bf16, 0.04,
                          tactic=4)
assert glu.grid == (80, 1, 1) and glu.extra == (40, 5000, 168, 300, 5 + 3), glu
assert glu.kernel.num_warps == 12 and glu.kernel.declared == 12, glu.kernel
assert ".maxnreg 168" in glu.kernel.ptx
assert glu.kernel.shared_mem <= 227 * 1024 and glu.kernel.global_scratch == 0, glu.kernel
# Gluon's tiles are powers of two: 256 takes its tactic, 320 and 384 (batch form) do not compile it
assert attn_trt.tactics(bf16, 64, 256) == [1, 2, 3, 4] and attn_trt.tactics(bf16, 64, 288) == [1, 2, 3]
assert attn_trt.tactics(bf16, 64, 320) == [1, 2, 3] and attn_trt.tactics(torch.float16, 64, 384) == [1, 2, 3]
with pytest.raises(ValueError, match="tactic 2 is not one of \\[1\\] for 8 heads of head_dim 64"):
    attn_trt.aot_launch((1, 2, 8, 64), (1, 50, 64), (1, 2, 16), (1, 10, 64), bf16, 0.1, tactic=2)
with pytest.raises(ValueError, match="not one of \\[1, 2\\] for 64 heads of head_dim 512 in torch.float32"):
    attn_trt.aot_launch((1, 2, 64, 512), (1, 50, 512), (1, 2, 16), (1, 10, 512), torch.float32, 0.1,
                        tactic=3)

# the split form: one decode row over 16 + 5 key blocks of 32; 128 rows keep one split each
sl = trt_split.aot_launch_split((1, 1, 64, 512), (1, 5000, 512), (1, 1, 512), (1, 129, 512), bf16, 0.04,
                                32, 66)
assert sl.grid == (1, 4, 21) and sl.extra == (1, 5000, 129, 512, 1) and sl.kernel.num_warps == 4, sl
many = trt_split.aot_launch_split((2, 64, 64, 512), (2, 5000, 512), (2, 64, 512), (2, 192, 512), bf16, 0.04,
                                  32, 66, tactic=2)
assert many.grid == (128, 4, 1) and many.extra[4] == 16 + 6, many
cmb = trt_split.aot_launch_combine((1, 1, 64, 512), (1, 1, 21, 64, 512), bf16)
assert cmb.grid == (1, 64, 1) and cmb.extra == (21,), cmb
# the combine's tactics: every split in one load (up to 32 at 512 dims), or chunks of 4
assert trt_split.combine_tactics() == [1, 2]
assert trt_split.combine_kernel(bf16, 64, 512)[1]["CHUNK"] == 32
assert trt_split.combine_kernel(bf16, 64, 512, tactic=2)[1]["CHUNK"] == 4
chunks = trt_split.aot_launch_combine((2, 64, 64, 512), (2, 64, 1, 64, 512), bf16, tactic=2)
assert chunks.grid == (128, 64, 1) and chunks.extra == (1,), chunks
with pytest.raises(ValueError, match="Csa2AttentionCombine: tactic 3 is not one of \\[1, 2\\]"):
    trt_split.combine_kernel(bf16, 64, 512, tactic=3)
with pytest.raises(ValueError, match="block_keys 48 is not one of the kernel's key blocks"):
    trt_split.split_kernel(bf16, 64, 512, 0.04, 48)
# the split node's GLUON tactic: the Gluon kernel over the node's own plan (32-key blocks of 512
# dims in 4 stages, 64-key blocks of 128 in 4), 16-bit, 64 heads; one head block per program
assert trt_split.tactics(bf16, 64, 512, 32) == [1, 2, 3]
assert trt_split.tactics(torch.float16, 64, 128, 64) == [1, 2, 3]
assert trt_split.tactics(torch.float32, 64, 512, 32) == [1, 2]
assert trt_split.tactics(bf16, 16, 512, 32) == [1, 2]
assert trt_split.tactics(bf16, 64, 512, 16) == [1, 2] and trt_split.tactics(bf16, 64, 384, 32) == [1, 2]
assert trt_split.gluon_stages(64, 512, bf16, 32) == 4 and trt_split.gluon_stages(64, 512, bf16, 64) == 2
assert trt_split.gluon_problem(bf16, 64, 512, 128).startswith("GLUON takes key blocks of 32 or 64")
ws = trt_split.aot_launch_split((2, 64, 64, 512), (2, 5000, 512), (2, 64, 512), (2, 192, 512), bf16, 0.04,
                                32, 66, tactic=3)
assert ws.grid == (128, 1, 1) and ws.extra == many.extra and ws.kernel.num_warps == 12, ws
assert ".maxnreg 168" in ws.kernel.ptx and ws.kernel.declared == 6 + 5 + 2 and ws.kernel.aligned
assert 200 * 1024 <= ws.kernel.shared_mem <= attn_kernel.SM90_SHARED_BYTES, ws.kernel.shared_mem
one = trt_split.aot_launch_split((1, 1, 64, 512), (1, 5000, 512), (1, 1, 512), (1, 129, 512), bf16, 0.04,
                                 32, 66, tactic=3)
assert one.grid == (1, 1, 21) and one.extra == sl.extra, one
with pytest.raises(ValueError, match="Csa2SparseAttentionSplit: GLUON takes bf16 or fp16, got torch.float32"):
    trt_split.split_kernel(torch.float32, 64, 512, 0.04, 32, tactic=3)
with pytest.raises(ValueError, match="tactic 4 is not one of \\[1, 2, 3\\]"):
    trt_split.split_kernel(bf16, 64, 512, 0.04, 32, tactic=4)

# mHC's split form: one decode token over 160 chunks of 32 channels; 64 rows (4 row blocks) over 54
# splits of 3 chunks
part = mhc_split.aot_launch_partials((1, 1, 4, 5120), (24, 20480), bf16, 32, 264)
assert part.grid == (1, 160, 1) and part.extra == (1, 1, 160), part
rows = mhc_split.aot_launch_partials((2, 32, 4, 5120), (24, 20480), bf16, 32, 264, tactic=mhc_split.ROWS_16)
assert rows.grid == (4, 54, 1) and rows.extra == (64, 3, 54), rows
fin = mhc_split.aot_launch_finish((1, 1, 5120), (160, 1, 1, 24), bf16, 20, 1e-6, 1e-6)
assert fin.grid == (1, 5120 // 256 + 1, 1) and fin.extra == (1, 160), fin
# no counters: TensorRT gives no workspace
assert "atom" not in part.kernel.ptx and "atom" not in fin.kernel.ptx
with pytest.raises(ValueError, match="MhcBoundaryPartials: tactic 4 is not one of"):
    mhc_split.partials_kernel(bf16, 4, 5120, 32, 4)
with pytest.raises(ValueError, match="block_e 48 is not one of"):
    mhc_split.aot_launch_partials((1, 1, 4, 5120), (24, 20480), bf16, 48, 264)
for b, s in ((1, 1), (3, 1), (2, 7), (1, 300), (4, 66)):
    want = mhc_split.partials_outputs((b, s, 4, 5120), (24, 20480), 32, 264)
    got = mhc_split.partials_outputs((Expr(b), Expr(s), 4, 5120), (24, 20480), 32, 264,
                                     trt_sizes(types.SimpleNamespace(**size_functions())))
    assert (value(got[0]), value(got[1])) == want[:2], (b, s, got, want)
    assert [tuple(value(x) for x in shape) for shape in got[2]] == want[2], (b, s)


fake_trtp = types.SimpleNamespace(**size_functions())
for b, s, k, t in ((1, 1, 512, 129), (3, 1, 512, 128), (1, 70, 512, 198), (2, 1, 0, 0), (1, 5, 7, 3)):
    want = trt_split.split_outputs((b, s, 64, 512), (b, s, k), (b, t, 512), 32, 66)
    got = trt_split.split_outputs((Expr(b), Expr(s), 64, 512), (Expr(b), Expr(s), Expr(k)),
                                  (Expr(b), Expr(t), 512), 32, 66, splits.trt_sizes(fake_trtp))
    values = (value(got[0]), tuple(value(x) for x in got[1]))
    assert values == (want[0], want[1]), (b, s, k, t, values, want)


fake = types.SimpleNamespace(KernelLaunchParams=Params, SymIntExprs=SymIntExprs,
                             SymInt32=lambda e: ("sym", e))
name, ptx, launch, extra = two.for_trt(fake)
assert name == two.kernel.name and ptx.startswith("//") and ".entry " + name in ptx
assert (launch.grid_x, launch.grid_y, launch.grid_z, launch.block_x) == (6, 257, 1, 256)
assert launch.shared_mem == two.kernel.shared_mem and extra == [("sym", 3), ("sym", 131075)]
"""


@pytest.mark.slow
def test_aot_launch_grids_tactics_and_trt_glue():
    """Each plugin's aot_launch over concrete shapes (grid, extra ints, tactics) and AotLaunch.for_trt
    against a stand-in for tensorrt.plugin's launch objects (compiles: a subprocess without the
    interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), env.get("PYTHONPATH")]))
    subprocess.run([sys.executable, "-c", AOT_LAUNCH_CHECKS], check=True, env=env, timeout=300)
