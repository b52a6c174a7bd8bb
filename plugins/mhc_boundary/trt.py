"""TensorRT registration of MhcBoundary (tensorrt.plugin AOT plugin): `aot_kernel` compiles
kernel.py's Triton kernel to PTX for sm_90 with its launch parameters (runs wherever Triton is
installed); `register()` adds the plugin where TensorRT imports.

TensorRT's AOT plugins get no workspace, so the plugin uses the whole-row path (SPLIT = 0: one
program per token block, no cross-program sums); the split path that spreads a decode token's
channels over the GPU needs the JIT launcher's self-clearing workspace. Three tactics, timed by
TensorRT per optimization profile (tactic_setting): blocks of 64 token rows (prefill), blocks of
16, and blocks of 16 whose channels a cluster of 8 CTAs splits, exchanging their sums through the
outputs between cluster barriers (finish.py: cluster_finish; decode).
"""

from __future__ import annotations

import dataclasses

import torch

from dsflash.plugins.aot import AotKernel, AotLaunch, cdiv_expr, compile_ptx, constant, pointer
from dsflash.plugins.declaration import DOMAIN
from dsflash.plugins.mhc_boundary import kernel
from dsflash.plugins.mhc_boundary.decl import DECL
from dsflash.plugins.mhc_boundary.reference import n_mixes


def kernel_signature(dtype: torch.dtype) -> dict:
    """Triton types of the kernel's non-constant parameters, in TensorRT's AOT order (aot_kernel
    drops the workspace pointers at the end, which only the JIT launcher's split path uses)."""
    x = pointer(dtype)
    return {"streams_ptr": x, "y_ptr": x, "post_ptr": "*fp32", "comb_ptr": "*fp32", "pre_ptr": "*fp32",
            "fn_ptr": "*fp32", "base_ptr": "*fp32", "scale_ptr": "*fp32", "nw_ptr": x, "T": "i32",
            "chunks_per_split": "i32", "n_split": "i32", "new_ptr": x, "x_ptr": x, "pre_out": "*fp32",
            "post_out": "*fp32", "comb_out": "*fp32", "ws_acc": "*fp32", "ws_sq": "*fp32", "counter": "*i32"}


def kernel_constants(cfg: dict, hc: int, hidden: int, iters: int, hc_eps: float, rms_eps: float,
                     split: bool, n_split_p2: int) -> dict:
    """The kernel's compile-time constants for a launch_config (less its launch options)."""
    return dict(C=hc, E=hidden, M=n_mixes(hc), ITERS=int(iters), HC_EPS=float(hc_eps),
                RMS_EPS=float(rms_eps), SPLIT=split, NSP=n_split_p2,
                **{k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")})


def aot_kernel(dtype: torch.dtype, tokens_hint: int, hc: int, hidden: int, iters: int, hc_eps: float,
               rms_eps: float, aligned: bool = True, overrides: dict | None = None) -> tuple[AotKernel, dict]:
    """(compiled kernel, launch: BLOCK_T for the grid (cdiv(B*S, BLOCK_T), 1)); the launch_config
    for `tokens_hint` tokens, `overrides` replacing entries (tactics, sweeps)."""
    cfg = kernel.launch_config(tokens_hint, hc, hidden, dtype) | dict(overrides or {})
    consts = kernel_constants(cfg, hc, hidden, iters, hc_eps, rms_eps, split=False, n_split_p2=1)
    # TensorRT passes the inputs, the extra ints and the outputs, nothing else: the split path's
    # workspace and counter become constant None, so the PTX does not declare them
    workspace = ("ws_acc", "ws_sq", "counter")
    consts |= dict.fromkeys(workspace)
    sig = {k: v for k, v in kernel_signature(dtype).items() if k not in workspace}
    ctas = cfg.get("CLUSTER", 1)
    if ctas > 1 and not cluster_fits(hc, hidden, dtype, cfg["BLOCK_E"], ctas):
        raise ValueError(f"MhcBoundary: hidden {hidden} is too narrow for clusters of {ctas} CTAs "
                         f"({cfg['BLOCK_E']}-channel chunks)")
    compiled = compile_ptx(kernel.mhc_boundary_kernel, sig, consts, cfg["num_warps"],
                           num_stages=cfg.get("num_stages"), aligned=aligned)
    if ctas > 1:
        compiled = dataclasses.replace(compiled, ptx=with_cluster_dims(compiled.ptx, compiled.name, ctas))
    return compiled, cfg


ROW_BLOCKS, FEW_TOKENS, CLUSTERED = 1, 2, 3  # tactic ids (TensorRT wants positive integers)


def tactic_setting(tactic: int) -> tuple[int, dict]:
    """(tokens_hint, launch_config overrides) of a tactic; 0 (TensorRT's default) is ROW_BLOCKS.
    ROW_BLOCKS: 64 token rows per program, the projection on the tensor cores (prefill; as fast
    as the JIT launch at 8,192 tokens). FEW_TOKENS: decode, where a program per 64 rows leaves
    one program for the whole step (scripts/bench_aot.py --sweep)."""
    tactic = tactic or ROW_BLOCKS
    if tactic not in (ROW_BLOCKS, FEW_TOKENS, CLUSTERED):
        raise ValueError(f"MhcBoundary: tactic {tactic} is not one of {[ROW_BLOCKS, FEW_TOKENS, CLUSTERED]}")
    # H200 sweep (bench_aot.py --sweep, 2026-12-03), whole rows per program, one token: 274 us
    # blocked for 64 rows, 140 us for 16 (tokens_hint 64: the tensor cores' smallest block; 141 us
    # at 8 tokens, 145 at 64), 189 us one row per program with 128-channel chunks and 8 warps.
    # CLUSTERED: 16-row blocks, each over a cluster of 8 CTAs splitting the channels (8: the largest
    # cluster every launch path accepts without an opt-in), in 64-channel chunks: one token 25.8 us,
    # 8 tokens 27.8, 64 tokens 30.7 (32-channel chunks 32.1 / 33.9 / 39.3; 8 warps 34.9 at one token;
    # one row per program 41.0)
    return {ROW_BLOCKS: (1 << 20, {}), FEW_TOKENS: (64, {}),
            CLUSTERED: (64, {"CLUSTER": 8, "BLOCK_E": 64})}[tactic]


def cluster_fits(hc: int, hidden: int, dtype: torch.dtype, block_e: int, ctas: int) -> bool:
    """Whether every CTA of a cluster gets channels, and room in its x columns for its M + 2 fp32
    partial sums (finish.cluster_finish)."""
    chunks = -(-hidden // block_e)
    per = -(-chunks // ctas)
    return (ctas - 1) * per < chunks and per * block_e * dtype.itemsize >= (n_mixes(hc) + 2) * 4


def tactics(hc: int, hidden: int, dtype: torch.dtype) -> list[int]:
    """The tactics that compile for these sizes (CLUSTERED needs enough channels)."""
    hint, over = tactic_setting(CLUSTERED)
    block_e = over.get("BLOCK_E", kernel.launch_config(hint, hc, hidden, dtype)["BLOCK_E"])
    fits = cluster_fits(hc, hidden, dtype, block_e, over["CLUSTER"])
    return [ROW_BLOCKS, FEW_TOKENS] + ([CLUSTERED] if fits else [])


def with_cluster_dims(ptx: str, entry: str, ctas: int) -> str:
    """The PTX with `entry` declaring clusters of `ctas` CTAs along x (.reqnctapercluster): a plain
    cuLaunchKernel (what TensorRT calls) then launches clusters, whose CTAs run at the same time
    and can meet at barrier.cluster."""
    head, sep, rest = ptx.partition(f".entry {entry}(")
    params, close, body = rest.partition(")")
    if not sep or not close or "{" not in body:
        raise ValueError(f"no .entry {entry} in the PTX")
    directives, brace, code = body.partition("{")
    cluster = f"\n.reqnctapercluster {ctas}, 1, 1\n"
    return head + sep + params + close + directives.rstrip() + cluster + brace + code


def aot_launch(streams_shape, dtype: torch.dtype, iters: int, hc_eps: float, rms_eps: float,
               aligned: bool = True, tactic: int = ROW_BLOCKS, tokens_hint: int | None = None,
               overrides: dict | None = None) -> AotLaunch:
    """The launch for streams [B, S, C, E] (ints or TensorRT shape expressions): whole rows per
    program, compiled for any token count; the tactic's blocking unless `tokens_hint` (with
    `overrides`) is given (sweeps)."""
    if tokens_hint is None:
        tokens_hint, overrides = tactic_setting(tactic)
    hc, hidden = constant(streams_shape[2]), constant(streams_shape[3])
    compiled, cfg = aot_kernel(dtype, tokens_hint, hc, hidden, iters, hc_eps, rms_eps, aligned, overrides)
    tokens = streams_shape[0] * streams_shape[1]
    # SPLIT = 0 ignores chunks_per_split and n_split; CLUSTER CTAs per token block
    grid = cdiv_expr(tokens, cfg["BLOCK_T"]) * cfg.get("CLUSTER", 1)
    return AotLaunch(compiled, (grid, 1, 1), (tokens, hidden, 1))


def register() -> None:
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from dsflash.plugins.trt_types import io_types, torch_dtypes

    plugin_id = f"{DOMAIN}::{DECL.name}"

    @trtp.register(plugin_id)
    def _desc(streams: trtp.TensorDesc, y: trtp.TensorDesc, post: trtp.TensorDesc, comb: trtp.TensorDesc,
              pre: trtp.TensorDesc, fn: trtp.TensorDesc, base: trtp.TensorDesc, scale: trtp.TensorDesc,
              norm_weight: trtp.TensorDesc, iters: int, hc_eps: float, rms_eps: float):
        b, s, c, e = (streams.shape_expr[i] for i in range(4))
        f32 = trt.float32
        return (streams.like(), trtp.from_shape_expr((b, s, e), dtype=streams.dtype),
                trtp.from_shape_expr((b, s, c), dtype=f32), trtp.from_shape_expr((b, s, c), dtype=f32),
                trtp.from_shape_expr((b, s, c, c), dtype=f32))

    @trtp.autotune(plugin_id)
    def _tune(streams, y, post, comb, pre, fn, base, scale, norm_weight, outputs):
        hc, hidden = (constant(streams.shape_expr[i]) for i in (2, 3))
        combos = []
        for x, dtype in (("BF16", torch.bfloat16), ("FP16", torch.float16), ("FP32", torch.float32)):
            combos.append(trtp.AutoTuneCombination(io_types(DECL, x), "LINEAR", tactics(hc, hidden, dtype)))
        return combos

    @trtp.aot_impl(plugin_id)
    def _aot(streams, y, post, comb, pre, fn, base, scale, norm_weight, iters: int, hc_eps: float,
             rms_eps: float, outputs, tactic: int):
        return aot_launch(streams.shape_expr, torch_dtypes(trt)[streams.dtype], iters, hc_eps,
                          rms_eps, tactic=tactic).for_trt(trtp)
