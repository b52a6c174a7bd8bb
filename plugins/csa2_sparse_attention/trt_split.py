"""TensorRT registration of the split form of Csa2SparseAttention, which decoder_step graphs use:
Csa2SparseAttentionSplit (each program attends one run of key blocks of one query row and head
block and writes its partial softmax, splits.py) and Csa2AttentionCombine (one program per row
and head merges the partials). An AOT plugin is one kernel with no workspace, so the two kernels
the JIT launcher runs for a decode step become two nodes with the partials as a tensor between
them; the one-node plugin (trt.py) puts a decode row's 640 keys on 4 programs (39 us against
6.8 us split, docs/benchmarks.md)."""

from __future__ import annotations

import torch

from dsflash.plugins.aot import AotKernel, AotLaunch, cdiv_expr, compile_ptx, constant, pointer
from dsflash.plugins.csa2_sparse_attention import kernel, splits
from dsflash.plugins.csa2_sparse_attention.decl import COMBINE_DECL, SPLIT_DECL
from dsflash.plugins.csa2_sparse_attention.trt import kernel_signature
from dsflash.plugins.declaration import DOMAIN
from dsflash.plugins.launch import next_pow2

ONE_BLOCK, PIPELINED = 1, 2  # split tactics: 1 or 3 software-pipeline stages


def tactics() -> list[int]:
    """ONE_BLOCK suits decode (a split holds one key block: nothing to overlap; H200 7.4 against
    8.7 us with 3 stages), PIPELINED many rows (one split of many blocks each)."""
    return [ONE_BLOCK, PIPELINED]


def split_kernel(dtype: torch.dtype, heads: int, dim: int, scale: float, block_keys: int,
                 tactic: int = ONE_BLOCK, idx_dtype: torch.dtype = torch.int64,
                 aligned: bool = True) -> tuple[AotKernel, dict]:
    """csa2_sparse_attention_kernel with SPLIT on: the output pointer becomes constant None, so the
    PTX declares the inputs, the five ints and the two partials TensorRT passes."""
    if tactic not in tactics():
        raise ValueError(f"Csa2SparseAttentionSplit: tactic {tactic} is not one of {tactics()}")
    if block_keys not in (16, 32, 64, 128):
        raise ValueError(f"Csa2SparseAttentionSplit: block_keys {block_keys} is not one of the "
                         f"kernel's key blocks (16, 32, 64, 128)")
    cfg = kernel.launch_config(heads, dim, dtype) | {"BLOCK_K": block_keys}
    sig = {k: v for k, v in kernel_signature(dtype, idx_dtype).items() if k != "out_ptr"}
    consts = dict(H=heads, D=dim, SCALE=float(scale), SPLIT=True, out_ptr=None,
                  **{k: v for k, v in cfg.items() if k != "num_warps"})
    stages = 1 if tactic == ONE_BLOCK else 3
    return compile_ptx(kernel.csa2_sparse_attention_kernel, sig, consts, cfg["num_warps"],
                       num_stages=stages, aligned=aligned), cfg | {"num_stages": stages}


def combine_kernel(dtype: torch.dtype, heads: int, dim: int, aligned: bool = True) -> tuple[AotKernel, dict]:
    """csa2_attention_combine_kernel for up to splits.max_splits(dim) partials per (row, head)."""
    cfg = {"BLOCK_D": next_pow2(dim, 16), "NSP": next_pow2(splits.max_splits(dim)), "num_warps": 4}
    consts = {"H": heads, "D": dim, "BLOCK_D": cfg["BLOCK_D"], "NSP": cfg["NSP"]}
    return compile_ptx(kernel.csa2_attention_combine_kernel, combine_signature(dtype), consts,
                       cfg["num_warps"], aligned=aligned), cfg


def combine_signature(dtype: torch.dtype) -> dict:
    """Triton types of csa2_attention_combine_kernel's arguments (also plugins/pdl.py's check)."""
    return {"q_ptr": pointer(dtype), "acc_ptr": "*fp32", "ml_ptr": "*fp32", "sink_ptr": "*fp32",
            "n_split": "i32", "out_ptr": pointer(dtype)}


def split_outputs(q_shape, idx_shape, win_shape, block_keys: int, split_target: int,
                  ops: splits.SizeOps = splits.TORCH_SIZES) -> tuple:
    """(blocks per split, acc shape, ml shape), over ints or TensorRT shape expressions."""
    b, s, h, d = (q_shape[i] for i in range(4))
    per, n_split = splits.split_plan(b * s, idx_shape[2], win_shape[1], constant(d), block_keys,
                                     split_target, ops=ops)
    return per, (b, s, n_split, h, d), (b, s, n_split, 2, h)


def aot_launch_split(q_shape, kv_shape, idx_shape, win_shape, dtype: torch.dtype, scale: float,
                     block_keys: int, split_target: int, tactic: int = ONE_BLOCK, aligned: bool = True,
                     ops: splits.SizeOps = splits.TORCH_SIZES) -> AotLaunch:
    """Grid (B*S rows, head blocks, splits); ints S, N, T, K and blocks per split."""
    heads, dim = constant(q_shape[2]), constant(q_shape[3])
    compiled, cfg = split_kernel(dtype, heads, dim, scale, block_keys, tactic, aligned=aligned)
    per, acc_shape, _ = split_outputs(q_shape, idx_shape, win_shape, block_keys, split_target, ops)
    grid = (q_shape[0] * q_shape[1], cdiv_expr(heads, cfg["BLOCK_H"]), acc_shape[2])
    return AotLaunch(compiled, grid, (q_shape[1], kv_shape[1], win_shape[1], idx_shape[2], per))


def aot_launch_combine(q_shape, acc_shape, dtype: torch.dtype, aligned: bool = True) -> AotLaunch:
    """Grid (B*S rows, heads); the int is the number of splits (acc's third dimension)."""
    heads, dim = constant(q_shape[2]), constant(q_shape[3])
    compiled, _ = combine_kernel(dtype, heads, dim, aligned=aligned)
    return AotLaunch(compiled, (q_shape[0] * q_shape[1], heads, 1), (acc_shape[2],))


def register() -> None:
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from dsflash.plugins.trt_types import io_types, torch_dtypes

    sizes = splits.trt_sizes(trtp)
    split_id, combine_id = f"{DOMAIN}::{SPLIT_DECL.name}", f"{DOMAIN}::{COMBINE_DECL.name}"

    @trtp.register(split_id)
    def _split_desc(q: trtp.TensorDesc, kv: trtp.TensorDesc, idx: trtp.TensorDesc, win_kv: trtp.TensorDesc,
                    win_mask: trtp.TensorDesc, sink: trtp.TensorDesc, scale: float, block_keys: int,
                    split_target: int):
        _, acc, ml = split_outputs(q.shape_expr, idx.shape_expr, win_kv.shape_expr, block_keys,
                                   split_target, sizes)
        return trtp.from_shape_expr(acc, dtype=trt.float32), trtp.from_shape_expr(ml, dtype=trt.float32)

    @trtp.autotune(split_id)
    def _split_tune(q, kv, idx, win_kv, win_mask, sink, scale, block_keys, split_target, outputs):
        return [trtp.AutoTuneCombination(io_types(SPLIT_DECL, "FP32|BF16|FP16"), "LINEAR", tactics())]

    @trtp.aot_impl(split_id)
    def _split_aot(q: trtp.TensorDesc, kv: trtp.TensorDesc, idx: trtp.TensorDesc, win_kv: trtp.TensorDesc,
                   win_mask: trtp.TensorDesc, sink: trtp.TensorDesc, scale: float, block_keys: int,
                   split_target: int, outputs, tactic: int):
        return aot_launch_split(q.shape_expr, kv.shape_expr, idx.shape_expr, win_kv.shape_expr,
                                torch_dtypes(trt)[q.dtype], scale, block_keys, split_target,
                                tactic=tactic or ONE_BLOCK, ops=sizes).for_trt(trtp)

    @trtp.register(combine_id)
    def _combine_desc(q: trtp.TensorDesc, acc: trtp.TensorDesc, ml: trtp.TensorDesc,
                      sink: trtp.TensorDesc) -> trtp.TensorDesc:
        return q.like()

    @trtp.autotune(combine_id)
    def _combine_tune(q, acc, ml, sink, outputs):
        return [trtp.AutoTuneCombination(io_types(COMBINE_DECL, "FP32|BF16|FP16"), "LINEAR")]

    @trtp.aot_impl(combine_id)
    def _combine_aot(q: trtp.TensorDesc, acc: trtp.TensorDesc, ml: trtp.TensorDesc, sink: trtp.TensorDesc,
                     outputs, tactic: int):
        return aot_launch_combine(q.shape_expr, acc.shape_expr, torch_dtypes(trt)[q.dtype]).for_trt(trtp)
