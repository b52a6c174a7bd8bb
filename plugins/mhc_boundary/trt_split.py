"""TensorRT registration of MhcBoundary's split form, which decoder_step graphs use:
MhcBoundaryPartials (kernel.mhc_boundary_kernel with SPLIT and PARTIALS_ONLY: a decode token's
channels over splits.py's splits, each writing its partial sums) and MhcBoundaryFinish
(split_form.mhc_boundary_finish_kernel: merge, coefficients, RMSNorm). An AOT plugin is one kernel
with no workspace, so the one-node plugin (trt.py) can only split a token's channels over a
cluster of 8 CTAs (24.3 us for one token on the H200, against 8.5 us for the JIT launcher's
split over the GPU); two nodes with the partials as tensors between them give TensorRT the JIT
launcher's split: 8.4 us for one token, 12.2 us for 64 (docs/benchmarks.md, session 14).
"""

from __future__ import annotations

import torch

from dsflash.plugins.aot import AotKernel, AotLaunch, cdiv_expr, compile_ptx, constant, pointer
from dsflash.plugins.declaration import DOMAIN
from dsflash.plugins.launch import next_pow2
from dsflash.plugins.mhc_boundary import kernel, split_form, splits
from dsflash.plugins.mhc_boundary.decl import FINISH_DECL, PARTIALS_DECL
from dsflash.plugins.mhc_boundary.reference import hc_from_mixes, n_mixes
from dsflash.plugins.mhc_boundary.trt import kernel_constants, kernel_signature
from dsflash.plugins.sizes import TORCH_SIZES, SizeOps

# tactics (TensorRT wants positive integers): rows per program of either kernel
ONE_ROW, ROWS_16, ROWS_64 = 1, 2, 3
PARTIALS_HINTS = {ONE_ROW: 1, ROWS_16: 64, ROWS_64: 1 << 20}  # launch_config's token counts for those
FINISH_HINTS = {ONE_ROW: 1, ROWS_16: 16}
# what the first node does not pass: the site, the norm, the coefficient outputs, the counter
_NOT_PARTIALS = ("base_ptr", "scale_ptr", "nw_ptr", "pre_out", "post_out", "comb_out", "counter")


def partials_tactics() -> list[int]:
    """ONE_ROW: one row per program, exact fp32 products (as the JIT launch at one token); ROWS_16 /
    ROWS_64: the projection on the tensor cores (ROWS_64 with 4 stages). H200 (session 14, with the
    finish's ONE_ROW): ROWS_16 fastest from 1 to 64 tokens (8.4 / 8.9 / 12.2 us at 1 / 4 / 64),
    ROWS_64 at 8,192 tokens (406.7 us, with the finish's ROWS_16)."""
    return list(PARTIALS_HINTS)


def finish_tactics() -> list[int]:
    """ONE_ROW: each row's splits merged by a program of its own (64 tokens: 12.2 against 17.8 us
    with ROWS_16, which merges 16 rows in one program); ROWS_16 for many rows and few splits."""
    return list(FINISH_HINTS)


def partials_kernel(dtype: torch.dtype, hc: int, hidden: int, block_e: int, tactic: int = ONE_ROW,
                    aligned: bool = True) -> tuple[AotKernel, dict]:
    """mhc_boundary_kernel with SPLIT and PARTIALS_ONLY; its PTX declares the five inputs, the three
    ints (tokens, chunks per split, splits) and the four outputs TensorRT passes."""
    if tactic not in PARTIALS_HINTS:
        raise ValueError(f"MhcBoundaryPartials: tactic {tactic} is not one of {partials_tactics()}")
    if block_e not in splits.BLOCK_ES:
        raise ValueError(f"MhcBoundaryPartials: block_e {block_e} is not one of {splits.BLOCK_ES}")
    cfg = split_form.partials_config(PARTIALS_HINTS[tactic], hc, hidden, dtype, block_e)
    consts = kernel_constants(cfg, hc, hidden, iters=1, hc_eps=0.0, rms_eps=0.0, split=True, n_split_p2=1)
    consts |= dict.fromkeys(_NOT_PARTIALS) | {"PARTIALS_ONLY": True}
    sig = {k: v for k, v in kernel_signature(dtype).items() if k not in _NOT_PARTIALS}
    return compile_ptx(kernel.mhc_boundary_kernel, sig, consts, cfg["num_warps"],
                       num_stages=cfg.get("num_stages"), aligned=aligned), cfg


def finish_kernel(dtype: torch.dtype, hc: int, hidden: int, iters: int, hc_eps: float, rms_eps: float,
                  tactic: int = ONE_ROW, aligned: bool = True) -> tuple[AotKernel, dict]:
    """mhc_boundary_finish_kernel for up to splits.MAX_SPLITS splits."""
    if tactic not in FINISH_HINTS:
        raise ValueError(f"MhcBoundaryFinish: tactic {tactic} is not one of {finish_tactics()}")
    cfg = split_form.finish_config(FINISH_HINTS[tactic], hidden)
    n_mix = n_mixes(hc)
    consts = dict(C=hc, E=hidden, M=n_mix, MP=next_pow2(n_mix, 16),
                  ITERS=int(iters), HC_EPS=float(hc_eps), RMS_EPS=float(rms_eps), NSP=splits.MAX_SPLITS,
                  **{k: v for k, v in cfg.items() if k != "num_warps"})
    return compile_ptx(split_form.mhc_boundary_finish_kernel, finish_signature(dtype), consts,
                       cfg["num_warps"], aligned=aligned), cfg


def finish_signature(dtype: torch.dtype) -> dict:
    """Triton types of mhc_boundary_finish_kernel's arguments, in TensorRT's AOT order."""
    x = pointer(dtype)
    return {"x_raw_ptr": x, "mixes_ptr": "*fp32", "sums_ptr": "*fp32", "base_ptr": "*fp32",
            "scale_ptr": "*fp32", "nw_ptr": x, "T": "i32", "n_split": "i32", "x_ptr": x, "pre_out": "*fp32",
            "post_out": "*fp32", "comb_out": "*fp32"}


def partials_outputs(streams_shape, fn_shape, block_e: int, split_target: int,
                     ops: SizeOps = TORCH_SIZES) -> tuple:
    """(chunks per split, splits, [new, x_raw, mixes, sums] shapes) over ints or shape expressions."""
    b, s, _, e = (streams_shape[i] for i in range(4))
    per, n_split = splits.split_plan(b * s, constant(e), block_e, split_target, ops=ops)
    return per, n_split, [tuple(streams_shape[i] for i in range(4)), (b, s, e), (n_split, b, s, fn_shape[0]),
                          (n_split, b, s, 2)]


def aot_launch_partials(streams_shape, fn_shape, dtype: torch.dtype, block_e: int, split_target: int,
                        tactic: int = ONE_ROW, aligned: bool = True, ops: SizeOps = TORCH_SIZES) -> AotLaunch:
    """Grid (token blocks, splits); ints: tokens, chunks per split, splits."""
    hc, hidden = constant(streams_shape[2]), constant(streams_shape[3])
    compiled, cfg = partials_kernel(dtype, hc, hidden, block_e, tactic, aligned)
    per, n_split, _ = partials_outputs(streams_shape, fn_shape, block_e, split_target, ops)
    tokens = streams_shape[0] * streams_shape[1]
    return AotLaunch(compiled, (cdiv_expr(tokens, cfg["BLOCK_T"]), n_split, 1), (tokens, per, n_split))


def aot_launch_finish(x_raw_shape, mixes_shape, dtype: torch.dtype, iters: int, hc_eps: float, rms_eps: float,
                      tactic: int = ONE_ROW, aligned: bool = True) -> AotLaunch:
    """Grid (token blocks, normalising programs + 1); ints: tokens, splits (mixes' first dimension)."""
    hc, hidden = hc_from_mixes(constant(mixes_shape[3])), constant(x_raw_shape[2])
    compiled, cfg = finish_kernel(dtype, hc, hidden, iters, hc_eps, rms_eps, tactic, aligned)
    tokens = x_raw_shape[0] * x_raw_shape[1]
    return AotLaunch(compiled, split_form.finish_grid(tokens, hidden, cfg), (tokens, mixes_shape[0]))


def register() -> None:
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from dsflash.plugins.sizes import trt_sizes
    from dsflash.plugins.trt_types import io_types, torch_dtypes

    sizes = trt_sizes(trtp)
    Desc = trtp.TensorDesc  # a type: the signatures below annotate with it
    partials_id, finish_id = f"{DOMAIN}::{PARTIALS_DECL.name}", f"{DOMAIN}::{FINISH_DECL.name}"

    @trtp.register(partials_id)
    def _partials_desc(streams: Desc, y: Desc, post: Desc, comb: Desc, pre: Desc, fn: Desc, block_e: int,
                       split_target: int):
        _, _, (_, x_raw, mixes, sums) = partials_outputs(streams.shape_expr, fn.shape_expr, block_e,
                                                         split_target, sizes)
        f32 = trt.float32
        return (streams.like(), trtp.from_shape_expr(x_raw, dtype=streams.dtype),
                trtp.from_shape_expr(mixes, dtype=f32), trtp.from_shape_expr(sums, dtype=f32))

    @trtp.autotune(partials_id)
    def _partials_tune(streams, y, post, comb, pre, fn, block_e, split_target, outputs):
        types = io_types(PARTIALS_DECL, "FP32|BF16|FP16")
        return [trtp.AutoTuneCombination(types, "LINEAR", partials_tactics())]

    @trtp.aot_impl(partials_id)
    def _partials_aot(streams: Desc, y: Desc, post: Desc, comb: Desc, pre: Desc, fn: Desc, block_e: int,
                      split_target: int, outputs, tactic: int):
        dtype = torch_dtypes(trt)[streams.dtype]
        return aot_launch_partials(streams.shape_expr, fn.shape_expr, dtype, block_e, split_target,
                                   tactic=tactic or ONE_ROW, ops=sizes).for_trt(trtp)

    @trtp.register(finish_id)
    def _finish_desc(x_raw: Desc, mixes: Desc, sums: Desc, base: Desc, scale: Desc, norm_weight: Desc,
                     iters: int, hc_eps: float, rms_eps: float):
        b, s = x_raw.shape_expr[0], x_raw.shape_expr[1]
        c = hc_from_mixes(constant(mixes.shape_expr[3]))
        f32 = trt.float32
        return (x_raw.like(), trtp.from_shape_expr((b, s, c), dtype=f32),
                trtp.from_shape_expr((b, s, c), dtype=f32), trtp.from_shape_expr((b, s, c, c), dtype=f32))

    @trtp.autotune(finish_id)
    def _finish_tune(x_raw, mixes, sums, base, scale, norm_weight, outputs):
        types = io_types(FINISH_DECL, "FP32|BF16|FP16")
        return [trtp.AutoTuneCombination(types, "LINEAR", finish_tactics())]

    @trtp.aot_impl(finish_id)
    def _finish_aot(x_raw: Desc, mixes: Desc, sums: Desc, base: Desc, scale: Desc, norm_weight: Desc,
                    iters: int, hc_eps: float, rms_eps: float, outputs, tactic: int):
        return aot_launch_finish(x_raw.shape_expr, mixes.shape_expr, torch_dtypes(trt)[x_raw.dtype], iters,
                                 hc_eps, rms_eps, tactic=tactic or ONE_ROW).for_trt(trtp)
