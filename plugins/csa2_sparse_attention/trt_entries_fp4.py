"""TensorRT registration of Csa2EntriesFp4: kv_qat's FP4 compressed entries (codes [B, N, D/2] and
e4m3 scale bits [B, N, D/16], uint8) decoded for the rows a selection names, into [B, S*K, D] of
q's dtype (entries_fp4.py's kernel, one tactic: the decode is a few byte loads and stores per
row). The attention plugins after it read those rows as their global entries."""

from __future__ import annotations

import torch

from dsflash.plugins.aot import AotKernel, AotLaunch, cdiv_expr, compile_ptx, constant, pointer
from dsflash.plugins.csa2_sparse_attention import entries_fp4
from dsflash.plugins.csa2_sparse_attention.decl import ENTRIES_FP4_DECL
from dsflash.plugins.declaration import DOMAIN
from dsflash.plugins.launch import next_pow2


def kernel_signature(dtype: torch.dtype) -> dict:
    """Triton types of csa2_entries_fp4_kernel's arguments: inputs, extra ints, output."""
    return {"q_ptr": pointer(dtype), "codes_ptr": "*u8", "scales_ptr": "*u8", "idx_ptr": "*i64", "N": "i32",
            "R": "i32", "TOTAL": "i32", "out_ptr": pointer(dtype)}


def aot_kernel(dtype: torch.dtype, dim: int, aligned: bool = True) -> tuple[AotKernel, dict]:
    """(compiled kernel, launch: ROWS output rows per program)."""
    if dim % 16:
        raise ValueError(f"Csa2EntriesFp4: head_dim {dim} is not a multiple of 16 (a scale per 16 channels)")
    cfg = {"ROWS": entries_fp4.ROWS, "num_warps": 4}
    consts = dict(C=dim // 2, CP=next_pow2(dim // 2), ROWS=cfg["ROWS"])
    return compile_ptx(entries_fp4.csa2_entries_fp4_kernel, kernel_signature(dtype), consts, cfg["num_warps"],
                       aligned=aligned), cfg


def output_shape(idx_shape, codes_shape) -> tuple:
    return (idx_shape[0], idx_shape[1] * idx_shape[2], codes_shape[2] * 2)


def aot_launch(codes_shape, idx_shape, dtype: torch.dtype, aligned: bool = True) -> AotLaunch:
    """The launch for codes [B, N, D/2] and ids [B, S, K] (ints or TensorRT shape expressions)."""
    compiled, cfg = aot_kernel(dtype, 2 * constant(codes_shape[2]), aligned)
    rows = idx_shape[1] * idx_shape[2]
    total = idx_shape[0] * rows
    return AotLaunch(compiled, (cdiv_expr(total, cfg["ROWS"]), 1, 1), (codes_shape[1], rows, total))


def register() -> None:
    import tensorrt.plugin as trtp

    from dsflash.plugins.trt_types import io_types, torch_dtypes

    plugin_id = f"{DOMAIN}::{ENTRIES_FP4_DECL.name}"

    @trtp.register(plugin_id)
    def _desc(q: trtp.TensorDesc, codes: trtp.TensorDesc, scales: trtp.TensorDesc,
              idx: trtp.TensorDesc) -> trtp.TensorDesc:
        return trtp.from_shape_expr(output_shape(idx.shape_expr, codes.shape_expr), dtype=q.dtype)

    @trtp.autotune(plugin_id)
    def _tune(q, codes, scales, idx, outputs):
        return [trtp.AutoTuneCombination(io_types(ENTRIES_FP4_DECL, "FP32|BF16|FP16"), "LINEAR")]

    @trtp.aot_impl(plugin_id)
    def _aot(q: trtp.TensorDesc, codes: trtp.TensorDesc, scales: trtp.TensorDesc, idx: trtp.TensorDesc,
             outputs, tactic: int):
        import tensorrt as trt

        return aot_launch(codes.shape_expr, idx.shape_expr, torch_dtypes(trt)[q.dtype]).for_trt(trtp)
