"""TensorRT registration of Csa2IndexScore (tensorrt.plugin AOT plugin): `aot_kernel` compiles
kernel.py's Triton kernel to PTX for sm_90 with its launch parameters (runs wherever Triton is
installed); `register()` adds the plugin where TensorRT imports."""

from __future__ import annotations

import torch

from dsflash.plugins.aot import AotKernel, cdiv_expr, compile_ptx, pointer
from dsflash.plugins.csa2_index_score import kernel
from dsflash.plugins.csa2_index_score.decl import DECL
from dsflash.plugins.declaration import DOMAIN


def kernel_signature(dtype: torch.dtype) -> dict:
    """Triton types of csa2_index_score_kernel's arguments (also plugins/pdl.py's check)."""
    return {"q_ptr": pointer(dtype), "w_ptr": "*fp32", "k_ptr": pointer(dtype), "vis_ptr": "*u8",
            "S": "i32", "N": "i32", "out_ptr": "*fp32"}


def aot_kernel(dtype: torch.dtype, heads: int, dim: int) -> tuple[AotKernel, dict]:
    """(compiled kernel, launch: BLOCK_N for the grid (B*S, cdiv(N, BLOCK_N)))."""
    cfg = kernel.launch_config(heads, dim, dtype)
    sig = kernel_signature(dtype)
    consts = dict(I=heads, J=dim, **{k: v for k, v in cfg.items() if k != "num_warps"})
    return compile_ptx(kernel.csa2_index_score_kernel, sig, consts, cfg["num_warps"]), cfg


def register() -> None:
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from dsflash.plugins.trt_types import torch_dtypes

    plugin_id = f"{DOMAIN}::{DECL.name}"

    @trtp.register(plugin_id)
    def _desc(q: trtp.TensorDesc, w: trtp.TensorDesc, k: trtp.TensorDesc,
              visible: trtp.TensorDesc) -> trtp.TensorDesc:
        return trtp.from_shape_expr((q.shape_expr[0], q.shape_expr[1], k.shape_expr[1]), dtype=trt.float32)

    @trtp.autotune(plugin_id)
    def _tune(q, w, k, visible, outputs):
        return [trtp.AutoTuneCombination("FP32|BF16|FP16, FP32, FP32|BF16|FP16, BOOL, FP32", "LINEAR")]

    @trtp.aot_impl(plugin_id)
    def _aot(q: trtp.TensorDesc, w: trtp.TensorDesc, k: trtp.TensorDesc, visible: trtp.TensorDesc,
             outputs, tactic: int):
        heads, dim = (int(q.shape_expr[i].constant_value()) for i in (2, 3))
        compiled, cfg = aot_kernel(torch_dtypes(trt)[q.dtype], heads, dim)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = q.shape_expr[0] * q.shape_expr[1]
        launch.grid_y = cdiv_expr(k.shape_expr[1], cfg["BLOCK_N"])
        launch.block_x = compiled.block_x
        launch.shared_mem = compiled.shared_mem
        extra = trtp.SymIntExprs(2)
        extra[0] = trtp.SymInt32(q.shape_expr[1])
        extra[1] = trtp.SymInt32(k.shape_expr[1])
        return compiled.name, compiled.ptx, launch, extra
