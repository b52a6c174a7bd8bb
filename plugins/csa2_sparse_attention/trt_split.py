"""TensorRT registration of the split form of Csa2SparseAttention, which decoder_step graphs use:
Csa2SparseAttentionSplit (each program attends one run of key blocks of one query row and head
block and writes its partial softmax, splits.py) and Csa2AttentionCombine (one program per row
and head merges the partials). An AOT plugin is one kernel with no workspace, so the two kernels
the JIT launcher runs for a decode step become two nodes with the partials as a tensor between
them; the one-node plugin (trt.py) puts a decode row's 640 keys on 4 programs (39 us against
6.8 us split, docs/benchmarks.md). At a decode batch the split node also has the warp-specialized
Gluon kernel (gluon_batch.py, SPLIT) as its GLUON tactic: the JIT launch's batch form, over the
node's own key blocks and splits, so its partials are the other tactics' (the reference's); the
combine node sums them in one load (one decode row) or in chunks of splits (a batch)."""

from __future__ import annotations

import torch

from dsflash.plugins.aot import AotKernel, AotLaunch, cdiv_expr, compile_ptx, constant, pointer
from dsflash.plugins.csa2_sparse_attention import kernel, splits
from dsflash.plugins.csa2_sparse_attention.decl import COMBINE_DECL, SPLIT_DECL
from dsflash.plugins.csa2_sparse_attention.trt import gluon_aot_kernel, kernel_signature
from dsflash.plugins.declaration import DOMAIN
from dsflash.plugins.launch import next_pow2

# split tactics: the Triton kernel with 1 or 3 software-pipeline stages, the Gluon kernel
ONE_BLOCK, PIPELINED, GLUON = 1, 2, 3


def tactics(dtype: torch.dtype, heads: int, dim: int, block_keys: int) -> list[int]:
    """ONE_BLOCK suits decode (a split holds one key block: nothing to overlap; H200 7.4 against
    8.7 us with 3 stages), PIPELINED many rows (one split of many blocks each), GLUON a decode
    batch, where gluon_problem finds nothing against it."""
    return [ONE_BLOCK, PIPELINED] + ([GLUON] if gluon_problem(dtype, heads, dim, block_keys) is None else [])


def gluon_stages(heads: int, dim: int, dtype: torch.dtype, block_keys: int) -> int:
    """The most key stages (4, 3 or 2) of `block_keys` rows that fit one sm_90 program's shared
    memory beside Q (kernel.gluon_shared_bytes), 0 if none does. 32-key blocks of 512 dims take 4
    (206 KB); the JIT launch's 64 take 2."""
    for stages in (4, 3, 2):
        need = kernel.gluon_shared_bytes(heads, dim, dtype.itemsize, block_keys, stages)
        if need <= kernel.SM90_SHARED_BYTES:
            return stages
    return 0


def gluon_problem(dtype: torch.dtype, heads: int, dim: int, block_keys: int) -> str | None:
    """Why the GLUON tactic cannot take these heads and key blocks, or None: the Gluon kernel's
    shapes (kernel.gluon_shape_problem) in blocks of 32 or 64 keys, the node's own (the tactic
    keeps the node's split plan, so that its partials are the other tactics')."""
    problem = kernel.gluon_shape_problem(heads, dim, dtype)
    if problem is not None:
        return problem
    if block_keys not in (32, 64):
        return f"GLUON takes key blocks of 32 or 64 (its logits wgmma), got block_keys {block_keys}"
    if not gluon_stages(heads, dim, dtype, block_keys):
        need = kernel.gluon_shared_bytes(heads, dim, dtype.itemsize, block_keys, 2)
        return (f"GLUON: two stages of {block_keys} keys of {dim} dims need {need} bytes of shared memory, "
                f"over the {kernel.SM90_SHARED_BYTES} an sm_90 program has")
    return None


def gluon_split_kernel(dtype: torch.dtype, heads: int, dim: int, scale: float, block_keys: int,
                       idx_dtype: torch.dtype = torch.int64, aligned: bool = True,
                       stages: int | None = None) -> tuple[AotKernel, dict]:
    """The Gluon kernel with SPLIT on for TensorRT (the GLUON tactic; trt.gluon_aot_kernel): the
    same arguments as split_kernel's; `stages` None: gluon_stages."""
    problem = gluon_problem(dtype, heads, dim, block_keys)
    if problem is not None:
        raise ValueError(f"Csa2SparseAttentionSplit: {problem}")
    stages = gluon_stages(heads, dim, dtype, block_keys) if stages is None else stages
    kernel.check_gluon_blocks(heads, dim, dtype, block_keys, stages)
    return gluon_aot_kernel(dtype, heads, dim, scale, idx_dtype, aligned, split=True, block_keys=block_keys,
                            stages=stages)


def split_kernel(dtype: torch.dtype, heads: int, dim: int, scale: float, block_keys: int,
                 tactic: int = ONE_BLOCK, idx_dtype: torch.dtype = torch.int64,
                 aligned: bool = True) -> tuple[AotKernel, dict]:
    """csa2_sparse_attention_kernel with SPLIT on: the output pointer becomes constant None, so the
    PTX declares the inputs, the five ints and the two partials TensorRT passes (GLUON:
    gluon_split_kernel, the same arguments)."""
    if tactic not in (ONE_BLOCK, PIPELINED, GLUON):
        raise ValueError(f"Csa2SparseAttentionSplit: tactic {tactic} is not one of "
                         f"{[ONE_BLOCK, PIPELINED, GLUON]}")
    if block_keys not in (16, 32, 64, 128):
        raise ValueError(f"Csa2SparseAttentionSplit: block_keys {block_keys} is not one of the "
                         f"kernel's key blocks (16, 32, 64, 128)")
    if tactic == GLUON:
        return gluon_split_kernel(dtype, heads, dim, scale, block_keys, idx_dtype, aligned)
    cfg = kernel.launch_config(heads, dim, dtype) | {"BLOCK_K": block_keys}
    sig = {k: v for k, v in kernel_signature(dtype, idx_dtype).items() if k != "out_ptr"}
    consts = dict(H=heads, D=dim, SCALE=float(scale), SPLIT=True, out_ptr=None,
                  **{k: v for k, v in cfg.items() if k != "num_warps"})
    stages = 1 if tactic == ONE_BLOCK else 3
    return compile_ptx(kernel.csa2_sparse_attention_kernel, sig, consts, cfg["num_warps"],
                       num_stages=stages, aligned=aligned), cfg | {"num_stages": stages}


# combine tactics: every split in one load, or in chunks of COMBINE_CHUNK splits
WHOLE, CHUNKS = 1, 2
COMBINE_CHUNK = 4


def combine_tactics() -> list[int]:
    """WHOLE suits one decode row (21 splits at 64 x 512: one load's latency; H100, both nodes, 8.1
    against 8.9 us), CHUNKS a decode batch of few splits a row (a program no longer holds or loads
    all 32 possible splits: 128 rows of one split, 57.5 against 79.7 us; bench_aot.py, one call)."""
    return [WHOLE, CHUNKS]


def combine_kernel(dtype: torch.dtype, heads: int, dim: int, aligned: bool = True,
                   tactic: int = WHOLE) -> tuple[AotKernel, dict]:
    """csa2_attention_combine_kernel for up to splits.max_splits(dim) partials per (row, head)."""
    if tactic not in combine_tactics():
        raise ValueError(f"Csa2AttentionCombine: tactic {tactic} is not one of {combine_tactics()}")
    nsp = next_pow2(splits.max_splits(dim))
    chunk = nsp if tactic == WHOLE else min(COMBINE_CHUNK, nsp)
    cfg = {"BLOCK_D": next_pow2(dim, 16), "NSP": nsp, "CHUNK": chunk, "num_warps": 4}
    consts = {"H": heads, "D": dim, "BLOCK_D": cfg["BLOCK_D"], "NSP": cfg["NSP"], "CHUNK": cfg["CHUNK"]}
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
    """Grid (B*S rows, head blocks (GLUON: one), splits); ints S, N, T, K and blocks per split."""
    heads, dim = constant(q_shape[2]), constant(q_shape[3])
    compiled, cfg = split_kernel(dtype, heads, dim, scale, block_keys, tactic, aligned=aligned)
    per, acc_shape, _ = split_outputs(q_shape, idx_shape, win_shape, block_keys, split_target, ops)
    grid = (q_shape[0] * q_shape[1], cdiv_expr(heads, cfg["BLOCK_H"]), acc_shape[2])
    return AotLaunch(compiled, grid, (q_shape[1], kv_shape[1], win_shape[1], idx_shape[2], per))


def aot_launch_combine(q_shape, acc_shape, dtype: torch.dtype, aligned: bool = True,
                       tactic: int = WHOLE) -> AotLaunch:
    """Grid (B*S rows, heads); the int is the number of splits (acc's third dimension)."""
    heads, dim = constant(q_shape[2]), constant(q_shape[3])
    compiled, _ = combine_kernel(dtype, heads, dim, aligned=aligned, tactic=tactic)
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
        heads, dim = constant(q.shape_expr[2]), constant(q.shape_expr[3])
        return [trtp.AutoTuneCombination(io_types(SPLIT_DECL, "BF16|FP16"), "LINEAR",
                                         tactics(torch.bfloat16, heads, dim, block_keys)),
                trtp.AutoTuneCombination(io_types(SPLIT_DECL, "FP32"), "LINEAR",
                                         tactics(torch.float32, heads, dim, block_keys))]

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
        return [trtp.AutoTuneCombination(io_types(COMBINE_DECL, "FP32|BF16|FP16"), "LINEAR",
                                         combine_tactics())]

    @trtp.aot_impl(combine_id)
    def _combine_aot(q: trtp.TensorDesc, acc: trtp.TensorDesc, ml: trtp.TensorDesc, sink: trtp.TensorDesc,
                     outputs, tactic: int):
        return aot_launch_combine(q.shape_expr, acc.shape_expr, torch_dtypes(trt)[q.dtype],
                                  tactic=tactic or WHOLE).for_trt(trtp)
