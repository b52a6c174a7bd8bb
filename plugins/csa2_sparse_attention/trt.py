"""TensorRT registration of Csa2SparseAttention (tensorrt.plugin AOT plugin): `aot_kernel`
compiles kernel.py's Triton kernel to PTX for sm_90 with its launch parameters (runs wherever
Triton is installed); `register()` adds the plugin where TensorRT imports. The softmax scale is
baked into the PTX. AOT plugins get no workspace, so the plugin runs the unsplit path (one
program per query row and head block), with tactics TensorRT times per profile: the JIT
launch's decode blocks, larger key blocks with more warps for decode, all 64 heads in one
program for many rows (tactic_overrides), and the warp-specialized Gluon kernel (gluon_batch.py)
for the same. Graphs of many rows (encoder_prefill) use it; decoder_step graphs the split form
(trt_split.py)."""

from __future__ import annotations

import torch

from dsflash.plugins.aot import AotKernel, AotLaunch, cdiv_expr, compile_ptx, constant, pointer
from dsflash.plugins.csa2_sparse_attention import kernel, splits
from dsflash.plugins.csa2_sparse_attention.decl import DECL
from dsflash.plugins.declaration import DOMAIN
from dsflash.plugins.launch import HALF_FLOATS, next_pow2


def kernel_signature(dtype: torch.dtype, idx_dtype: torch.dtype = torch.int64) -> dict:
    """Triton types of csa2_sparse_attention_kernel's arguments (also plugins/pdl.py's check)."""
    return {"q_ptr": pointer(dtype), "kv_ptr": pointer(dtype), "idx_ptr": pointer(idx_dtype),
            "win_ptr": pointer(dtype), "wmask_ptr": "*u8", "sink_ptr": "*fp32", "S": "i32", "N": "i32",
            "T": "i32", "K": "i32", "blocks_per_split": "i32", "out_ptr": pointer(dtype), "acc_ptr": "*fp32",
            "ml_ptr": "*fp32"}


def aot_kernel(dtype: torch.dtype, heads: int, dim: int, scale: float,
               idx_dtype: torch.dtype = torch.int64, aligned: bool = True,
               overrides: dict | None = None) -> tuple[AotKernel, dict]:
    """(compiled kernel, launch: BLOCK_H for the grid (B*S, cdiv(H, BLOCK_H))); `overrides`
    replaces launch_config entries and num_stages (tactics, sweeps); GLUON True compiles the
    warp-specialized Gluon kernel instead (gluon_batch.py, unsplit, 64-key blocks)."""
    if (overrides or {}).get("GLUON", False):
        return gluon_aot_kernel(dtype, heads, dim, scale, idx_dtype, aligned)
    cfg = kernel.launch_config(heads, dim, dtype) | dict(overrides or {})
    # TensorRT passes the inputs, the extra ints and the output, nothing else: the partials'
    # pointers of the split form become constant None, so the PTX does not declare them
    sig = {k: v for k, v in kernel_signature(dtype, idx_dtype).items() if k not in ("acc_ptr", "ml_ptr")}
    consts = dict(H=heads, D=dim, SCALE=float(scale), SPLIT=False, acc_ptr=None, ml_ptr=None,
                  **{k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")})
    return compile_ptx(kernel.csa2_sparse_attention_kernel, sig, consts, cfg["num_warps"],
                       num_stages=cfg.get("num_stages"), aligned=aligned), cfg


def gluon_aot_kernel(dtype: torch.dtype, heads: int, dim: int, scale: float,
                     idx_dtype: torch.dtype = torch.int64, aligned: bool = True, split: bool = False,
                     block_keys: int | None = None, stages: int | None = None) -> tuple[AotKernel, dict]:
    """The Gluon kernel for TensorRT: unsplit as this plugin's GLUON tactic (the partials'
    pointers constant None as in aot_kernel; 64-key blocks in GLUON_STAGES stages, 214 KB of
    shared memory), or with `split` as the split node's (trt_split.py; the output pointer constant
    None, the node's `block_keys` in `stages`). 12 warps, the kernel's register cap in the PTX
    (.maxnreg). sm_90 only (wgmma, setmaxnreg): TensorRT times it on the GPU it builds for."""
    from dsflash.plugins.csa2_sparse_attention import gluon_batch

    dropped = ("out_ptr",) if split else ("acc_ptr", "ml_ptr")
    sig = {k: v for k, v in kernel_signature(dtype, idx_dtype).items() if k not in dropped}
    keys = kernel.gluon_block_keys() if block_keys is None else block_keys
    stages = kernel.GLUON_STAGES if stages is None else stages
    consts = dict(H=heads, D=dim, SCALE=float(scale), KB=keys, STAGES=stages, SPLIT=split,
                  **dict.fromkeys(dropped), num_warps=8)
    compiled = compile_ptx(gluon_batch.csa2_sparse_attention_ws_kernel, sig, consts, 8, aligned=aligned,
                           maxnreg=gluon_batch.MAXNREG)
    return compiled, {"BLOCK_H": heads, "BLOCK_K": keys, "GLUON": True} | (
        {"GLUON_STAGES": stages} if split else {})


ROWS, DECODE, BATCH, GLUON = 1, 2, 3, 4  # tactic ids (TensorRT wants positive integers)


def tactic_overrides(tactic: int, dtype: torch.dtype, heads: int, dim: int) -> dict:
    """launch_config overrides of a tactic; 0 (TensorRT's default) is ROWS. ROWS: launch_config
    as the JIT launch of few rows. DECODE (head_dim >= 256): 64-key blocks and 8 warps, for the
    few programs of a decode step (one per 16 heads); H200 sweep (bench_aot.py --sweep,
    2026-12-03), one row, 64 x 512 heads, 640 keys: 39.5 us against 49.8 us (2 stages 45.2, 1
    stage 47.1). BATCH (64 heads of 256-512 dims, 16-bit): the JIT launch's batch form with
    64-key blocks (splits.launch_config), all heads in one program; unsplit, as a plugin without
    a workspace runs, the JIT kernel took 57.8 us at 64 rows and 62.2 at 128 against 77.2 and
    130.6 for the decode blocks split over the GPU (bench_layer_batch.py --attn-configs,
    2026-12-04)."""
    tactic = tactic or ROWS
    if tactic not in tactics(dtype, heads, dim):
        raise ValueError(f"Csa2SparseAttention: tactic {tactic} is not one of {tactics(dtype, heads, dim)} "
                         f"for {heads} heads of head_dim {dim} in {dtype}")
    if tactic == GLUON:
        return {"GLUON": True}
    if tactic == BATCH:
        # the many-rows blocks: the plugin runs unsplit, one program per row, as the JIT launch
        # does above AHEAD_ROWS, where 64-key blocks in 2 stages were fastest
        cfg = kernel.launch_config(heads, dim, dtype, rows=splits.AHEAD_ROWS + 1)
        return {k: cfg[k] for k in ("BLOCK_H", "BLOCK_K", "num_warps", "num_stages")}
    return {"BLOCK_K": 64, "num_warps": 8} if tactic == DECODE else {}


def tactics(dtype: torch.dtype, heads: int, dim: int) -> list[int]:
    """The tactics for these heads: DECODE changes the blocks of wide heads only; BATCH needs
    16-bit operands (splits.batch_form); GLUON too, and kernel.gluon_shape_problem's shapes
    (gluon_batch.py, unsplit: the JIT launch's choice from 64 rows)."""
    if next_pow2(dim, 16) < 256:
        return [ROWS]
    batch = dtype in HALF_FLOATS and splits.batch_form(heads, dim, splits.BATCH_ROWS, ieee=False)
    gluon = batch and kernel.gluon_shape_problem(heads, dim, dtype) is None
    return [ROWS, DECODE, BATCH] + ([GLUON] if gluon else []) if batch else [ROWS, DECODE]


def aot_launch(q_shape, kv_shape, idx_shape, win_shape, dtype: torch.dtype, scale: float,
               aligned: bool = True, overrides: dict | None = None, tactic: int = ROWS) -> AotLaunch:
    """The launch for q [B, S, H, D], kv [B, N, D], idx [B, S, K] and win_kv [B, T, D] (ints or
    TensorRT shape expressions); the tactic's settings unless `overrides` is given (sweeps)."""
    heads, dim = constant(q_shape[2]), constant(q_shape[3])
    if overrides is None:
        overrides = tactic_overrides(tactic, dtype, heads, dim)
    compiled, cfg = aot_kernel(dtype, heads, dim, scale, aligned=aligned, overrides=overrides)
    # no workspace in an AOT plugin: one split owns every key block
    k_blocks = cdiv_expr(idx_shape[2], cfg["BLOCK_K"]) + cdiv_expr(win_shape[1], cfg["BLOCK_K"])
    grid = (q_shape[0] * q_shape[1], cdiv_expr(heads, cfg["BLOCK_H"]), 1)
    return AotLaunch(compiled, grid, (q_shape[1], kv_shape[1], win_shape[1], idx_shape[2], k_blocks))


def register() -> None:
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from dsflash.plugins.trt_types import io_types, torch_dtypes

    plugin_id = f"{DOMAIN}::{DECL.name}"

    @trtp.register(plugin_id)
    def _desc(q: trtp.TensorDesc, kv: trtp.TensorDesc, idx: trtp.TensorDesc, win_kv: trtp.TensorDesc,
              win_mask: trtp.TensorDesc, sink: trtp.TensorDesc, scale: float) -> trtp.TensorDesc:
        return q.like()

    @trtp.autotune(plugin_id)
    def _tune(q, kv, idx, win_kv, win_mask, sink, scale, outputs):
        heads, dim = constant(q.shape_expr[2]), constant(q.shape_expr[3])
        return [trtp.AutoTuneCombination(io_types(DECL, "BF16|FP16"), "LINEAR",
                                         tactics(torch.bfloat16, heads, dim)),
                trtp.AutoTuneCombination(io_types(DECL, "FP32"), "LINEAR",
                                         tactics(torch.float32, heads, dim))]

    @trtp.aot_impl(plugin_id)
    def _aot(q: trtp.TensorDesc, kv: trtp.TensorDesc, idx: trtp.TensorDesc, win_kv: trtp.TensorDesc,
             win_mask: trtp.TensorDesc, sink: trtp.TensorDesc, scale: float, outputs, tactic: int):
        return aot_launch(q.shape_expr, kv.shape_expr, idx.shape_expr, win_kv.shape_expr,
                          torch_dtypes(trt)[q.dtype], scale, tactic=tactic).for_trt(trtp)
