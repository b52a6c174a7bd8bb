"""TensorRT registration of Csa2SparseAttention (tensorrt.plugin AOT plugin): `aot_kernel`
compiles kernel.py's Triton kernel to PTX for sm_90 with its launch parameters (runs wherever
Triton is installed); `register()` adds the plugin where TensorRT imports. The softmax scale is
baked into the PTX. AOT plugins get no workspace, so the plugin runs the unsplit path (one
program per query row and head block)."""

from __future__ import annotations

import torch

from dsflash.plugins.aot import AotKernel, cdiv_expr, compile_ptx, pointer
from dsflash.plugins.csa2_sparse_attention import kernel
from dsflash.plugins.csa2_sparse_attention.decl import DECL
from dsflash.plugins.declaration import DOMAIN


def kernel_signature(dtype: torch.dtype, idx_dtype: torch.dtype = torch.int64) -> dict:
    """Triton types of csa2_sparse_attention_kernel's arguments (also plugins/pdl.py's check)."""
    return {"q_ptr": pointer(dtype), "kv_ptr": pointer(dtype), "idx_ptr": pointer(idx_dtype),
            "win_ptr": pointer(dtype), "wmask_ptr": "*u8", "sink_ptr": "*fp32", "S": "i32", "N": "i32",
            "T": "i32", "K": "i32", "blocks_per_split": "i32", "out_ptr": pointer(dtype), "ws_acc": "*fp32",
            "ws_ml": "*fp32"}


def aot_kernel(dtype: torch.dtype, heads: int, dim: int, scale: float,
               idx_dtype: torch.dtype = torch.int64) -> tuple[AotKernel, dict]:
    """(compiled kernel, launch: BLOCK_H for the grid (B*S, cdiv(H, BLOCK_H)))."""
    cfg = kernel.launch_config(heads, dim, dtype)
    cfg.pop("MIN_BLOCKS_PER_SPLIT")  # no workspace in an AOT plugin: no key split
    sig = kernel_signature(dtype, idx_dtype)
    consts = dict(H=heads, D=dim, SCALE=float(scale), SPLIT=False,
                  **{k: v for k, v in cfg.items() if k != "num_warps"})
    return compile_ptx(kernel.csa2_sparse_attention_kernel, sig, consts, cfg["num_warps"]), cfg


def register() -> None:
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from dsflash.plugins.trt_types import torch_dtypes

    plugin_id = f"{DOMAIN}::{DECL.name}"

    @trtp.register(plugin_id)
    def _desc(q: trtp.TensorDesc, kv: trtp.TensorDesc, idx: trtp.TensorDesc, win_kv: trtp.TensorDesc,
              win_mask: trtp.TensorDesc, sink: trtp.TensorDesc, scale: float) -> trtp.TensorDesc:
        return q.like()

    @trtp.autotune(plugin_id)
    def _tune(q, kv, idx, win_kv, win_mask, sink, scale, outputs):
        return [trtp.AutoTuneCombination("FP32|BF16|FP16, FP32|BF16|FP16, INT64, FP32|BF16|FP16, BOOL, "
                                         "FP32, FP32|BF16|FP16", "LINEAR")]

    @trtp.aot_impl(plugin_id)
    def _aot(q: trtp.TensorDesc, kv: trtp.TensorDesc, idx: trtp.TensorDesc, win_kv: trtp.TensorDesc,
             win_mask: trtp.TensorDesc, sink: trtp.TensorDesc, scale: float, outputs, tactic: int):
        heads, dim = (int(q.shape_expr[i].constant_value()) for i in (2, 3))
        compiled, cfg = aot_kernel(torch_dtypes(trt)[q.dtype], heads, dim, scale)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = q.shape_expr[0] * q.shape_expr[1]
        launch.grid_y = cdiv_expr(heads, cfg["BLOCK_H"])
        launch.block_x = compiled.block_x
        launch.shared_mem = compiled.shared_mem
        extra = trtp.SymIntExprs(5)
        # no workspace in an AOT plugin: one split owns every key block
        k_blocks = (cdiv_expr(idx.shape_expr[2], cfg["BLOCK_K"])
                    + cdiv_expr(win_kv.shape_expr[1], cfg["BLOCK_K"]))
        for i, e in enumerate((q.shape_expr[1], kv.shape_expr[1], win_kv.shape_expr[1], idx.shape_expr[2],
                               k_blocks)):
            extra[i] = trtp.SymInt32(e)
        return compiled.name, compiled.ptx, launch, extra
