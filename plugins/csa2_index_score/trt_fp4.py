"""TensorRT registration of Csa2IndexScoreFp4: the index scores over kv_qat models' FP4 index
keys (codes [B, N, J/2] uint8, one power-of-two exponent per 32 channels [B, N, J/32] int8), as
trt.py registers Csa2IndexScore.

Two tactics, timed by TensorRT's autotuning: 1, the keys decoded to the queries' dtype in
registers (kernel.py:csa2_index_score_fp4_kernel; every dtype and head count); 2, the FP8
tensor-core products (fp4_mma.py; bf16 queries, a power-of-two head count >= 16) in the JIT
launcher's one-row form (4 blocks of 64 entries per program, a block nothing sees skipped): the
JIT launch picks the FP8 path from 32K entries (kernel.py:csa2_index_score_fp4), which a plugin
compiled before N is known cannot decide, hence a tactic. The exponents stay bytes (EXP_WORDS
off): TensorRT does not promise the 4-byte alignment of an int8 tensor's rows.
"""

from __future__ import annotations

import torch

from dsflash.plugins.aot import AotKernel, AotLaunch, cdiv_expr, compile_ptx, constant, pointer
from dsflash.plugins.csa2_index_score import kernel
from dsflash.plugins.csa2_index_score.decl import FP4_DECL
from dsflash.plugins.declaration import DOMAIN
from dsflash.plugins.launch import next_pow2

DECODE, MMA = 1, 2  # tactic ids (TensorRT wants positive integers)
MMA_LAUNCH = {"BLOCK_N": 64, "BLOCKS": 4, "STAGES": 0, "EXP_WORDS": False, "num_warps": 4}


def kernel_signature(dtype: torch.dtype) -> dict:
    """Triton types of both kernels' arguments (the same order: q, w, codes, exps, visible, S, N, out)."""
    return {"q_ptr": pointer(dtype), "w_ptr": "*fp32", "codes_ptr": "*u8", "exps_ptr": "*i8",
            "vis_ptr": "*u8", "S": "i32", "N": "i32", "out_ptr": "*fp32"}


def tactics(dtype: torch.dtype, heads: int) -> list[int]:
    """The tactics that compile for these queries."""
    mma = dtype == torch.bfloat16 and heads >= 16 and heads == next_pow2(heads)
    return [DECODE, MMA] if mma else [DECODE]


def aot_kernel(dtype: torch.dtype, heads: int, dim: int, tactic: int = DECODE,
               aligned: bool = True) -> tuple[AotKernel, dict]:
    """(compiled kernel, launch: entries per program BLOCK_N x BLOCKS for the grid (B*S, cdiv(N, .)))."""
    tactic = tactic or DECODE
    if tactic not in tactics(dtype, heads):
        raise ValueError(f"Csa2IndexScoreFp4: tactic {tactic} is not one of {tactics(dtype, heads)} for "
                         f"{dtype} queries of {heads} heads")
    if dim % 32:
        raise ValueError(f"Csa2IndexScoreFp4: index_head_dim {dim} is not a multiple of 32")
    if tactic == DECODE:
        cfg = kernel.launch_config(heads, dim, dtype)
        consts = dict(I=heads, J=dim, **{k: v for k, v in cfg.items() if k != "num_warps"})
        compiled = compile_ptx(kernel.csa2_index_score_fp4_kernel, kernel_signature(dtype), consts,
                               cfg["num_warps"], aligned=aligned)
        return compiled, cfg
    from dsflash.plugins.csa2_index_score.fp4_mma import csa2_index_score_fp4_mma_kernel

    cfg = dict(MMA_LAUNCH)
    consts = dict(I=heads, J=dim, JP=next_pow2(dim), ASM=True,
                  **{k: v for k, v in cfg.items() if k != "num_warps"})
    compiled = compile_ptx(csa2_index_score_fp4_mma_kernel, kernel_signature(dtype), consts, cfg["num_warps"],
                           aligned=aligned)
    return compiled, cfg


def aot_launch(q_shape, codes_shape, dtype: torch.dtype, tactic: int = DECODE,
               aligned: bool = True) -> AotLaunch:
    """The launch for q [B, S, I, J] and codes [B, N, J/2] (ints or TensorRT shape expressions)."""
    compiled, cfg = aot_kernel(dtype, constant(q_shape[2]), constant(q_shape[3]), tactic, aligned)
    grid = (q_shape[0] * q_shape[1], cdiv_expr(codes_shape[1], cfg["BLOCK_N"] * cfg.get("BLOCKS", 1)), 1)
    return AotLaunch(compiled, grid, (q_shape[1], codes_shape[1]))


def register() -> None:
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from dsflash.plugins.trt_types import io_types, torch_dtypes

    plugin_id = f"{DOMAIN}::{FP4_DECL.name}"

    @trtp.register(plugin_id)
    def _desc(q: trtp.TensorDesc, w: trtp.TensorDesc, codes: trtp.TensorDesc, exps: trtp.TensorDesc,
              visible: trtp.TensorDesc) -> trtp.TensorDesc:
        shape = (q.shape_expr[0], q.shape_expr[1], codes.shape_expr[1])
        return trtp.from_shape_expr(shape, dtype=trt.float32)

    @trtp.autotune(plugin_id)
    def _tune(q, w, codes, exps, visible, outputs):
        heads = constant(q.shape_expr[2])
        bf16 = tactics(torch.bfloat16, heads)
        return [trtp.AutoTuneCombination(io_types(FP4_DECL, "BF16"), "LINEAR", bf16),
                trtp.AutoTuneCombination(io_types(FP4_DECL, "FP16|FP32"), "LINEAR", [DECODE])]

    @trtp.aot_impl(plugin_id)
    def _aot(q: trtp.TensorDesc, w: trtp.TensorDesc, codes: trtp.TensorDesc, exps: trtp.TensorDesc,
             visible: trtp.TensorDesc, outputs, tactic: int):
        return aot_launch(q.shape_expr, codes.shape_expr, torch_dtypes(trt)[q.dtype], tactic).for_trt(trtp)
