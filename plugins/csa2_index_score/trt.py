"""TensorRT registration of Csa2IndexScore (tensorrt.plugin AOT plugin): `aot_launch` compiles
kernel.py's Triton kernel to PTX for sm_90 with its launch parameters (runs wherever Triton is
installed; plugins/ptx_launch.py runs the result on a GPU the way TensorRT would); `register()` adds
the plugin where TensorRT imports.

Two tactics, timed by TensorRT's autotuning per optimization profile: 1, one block of entries per
program (every dtype and size); 2, the software-pipelined loop of four 128-entry blocks per program
(16-bit keys, index_head_dim <= 128), which the JIT launcher picks for long rows (kernel.py:
pipelined_config; H200 at 128K entries: 7.9 against 9.3 us). The JIT launcher decides from N, which
the plugin's kernel does not know when it compiles, hence a tactic."""

from __future__ import annotations

import torch

from dsflash.plugins.aot import AotKernel, AotLaunch, cdiv_expr, compile_ptx, constant, pointer
from dsflash.plugins.csa2_index_score import kernel
from dsflash.plugins.csa2_index_score.decl import DECL
from dsflash.plugins.declaration import DOMAIN
from dsflash.plugins.launch import HALF_FLOATS

ONE_BLOCK, PIPELINED = 1, 2  # tactic ids (TensorRT wants positive integers)


def kernel_signature(dtype: torch.dtype) -> dict:
    """Triton types of csa2_index_score_kernel's arguments (also plugins/pdl.py's check)."""
    return {"q_ptr": pointer(dtype), "w_ptr": "*fp32", "k_ptr": pointer(dtype), "vis_ptr": "*u8",
            "S": "i32", "N": "i32", "out_ptr": "*fp32"}


def tactics(dtype: torch.dtype, dim: int) -> list[int]:
    """The tactics that compile for these keys."""
    return [ONE_BLOCK, PIPELINED] if dtype in HALF_FLOATS and dim <= 128 else [ONE_BLOCK]


def tactic_config(dtype: torch.dtype, heads: int, dim: int, tactic: int) -> dict:
    """launch_config, with the pipelined loop's settings for tactic 2; tactic 0 (TensorRT's default
    when none is advertised) is the one-block kernel."""
    tactic = tactic or ONE_BLOCK
    if tactic not in tactics(dtype, dim):
        raise ValueError(f"Csa2IndexScore: tactic {tactic} is not one of {tactics(dtype, dim)} for "
                         f"{dtype} keys of {dim} channels")
    cfg = kernel.launch_config(heads, dim, dtype)
    return cfg | (kernel.pipelined_launch() if tactic == PIPELINED else {})


def aot_kernel(dtype: torch.dtype, heads: int, dim: int, tactic: int = ONE_BLOCK,
               aligned: bool = True) -> tuple[AotKernel, dict]:
    """(compiled kernel, launch: entries per program BLOCK_N x BLOCKS for the grid (B*S, cdiv(N, .)))."""
    cfg = tactic_config(dtype, heads, dim, tactic)
    consts = dict(I=heads, J=dim, **{k: v for k, v in cfg.items() if k != "num_warps"})
    return compile_ptx(kernel.csa2_index_score_kernel, kernel_signature(dtype), consts, cfg["num_warps"],
                       aligned=aligned), cfg


def aot_launch(q_shape, k_shape, dtype: torch.dtype, tactic: int = ONE_BLOCK,
               aligned: bool = True) -> AotLaunch:
    """The launch for q [B, S, I, J] and keys [B, N, J] (ints or TensorRT shape expressions)."""
    compiled, cfg = aot_kernel(dtype, constant(q_shape[2]), constant(q_shape[3]), tactic, aligned)
    grid = (q_shape[0] * q_shape[1], cdiv_expr(k_shape[1], cfg["BLOCK_N"] * cfg.get("BLOCKS", 1)), 1)
    return AotLaunch(compiled, grid, (q_shape[1], k_shape[1]))


def register() -> None:
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from dsflash.plugins.trt_types import io_types, torch_dtypes

    plugin_id = f"{DOMAIN}::{DECL.name}"

    @trtp.register(plugin_id)
    def _desc(q: trtp.TensorDesc, w: trtp.TensorDesc, k: trtp.TensorDesc,
              visible: trtp.TensorDesc) -> trtp.TensorDesc:
        return trtp.from_shape_expr((q.shape_expr[0], q.shape_expr[1], k.shape_expr[1]), dtype=trt.float32)

    @trtp.autotune(plugin_id)
    def _tune(q, w, k, visible, outputs):
        both = tactics(torch.bfloat16, constant(q.shape_expr[3]))
        return [trtp.AutoTuneCombination(io_types(DECL, "BF16|FP16"), "LINEAR", both),
                trtp.AutoTuneCombination(io_types(DECL, "FP32"), "LINEAR", [ONE_BLOCK])]

    @trtp.aot_impl(plugin_id)
    def _aot(q: trtp.TensorDesc, w: trtp.TensorDesc, k: trtp.TensorDesc, visible: trtp.TensorDesc,
             outputs, tactic: int):
        return aot_launch(q.shape_expr, k.shape_expr, torch_dtypes(trt)[q.dtype], tactic).for_trt(trtp)
