"""MhcBoundary's split form, as decoder_step graphs run it in TensorRT (trt_split.py): two kernels
with the partial sums as tensors between them, where the JIT launcher (kernel.py) runs one launch
with a self-clearing workspace that an AOT plugin does not get.

- MhcBoundaryPartials: kernel.mhc_boundary_kernel with SPLIT and PARTIALS_ONLY: programs of
  (token block, channel split) write the new residual, the unnormalised collapse x and their
  share of the projection and of the sums of squares ([P, B*S, M] and [P, B*S, 2]; splits.py).
- MhcBoundaryFinish (mhc_boundary_finish_kernel): programs of (token block, NORM_E channels)
  normalise x into the output, each adding up the splits' sums of x^2 for its rows; one more
  program per token block merges the partial projections and writes the next coefficients
  (finish.finish_block: the same merge, sigmoids and Sinkhorn as the one-node kernel).
The launchers below take the references' signatures (reference.mhc_boundary_partials /
mhc_boundary_finish) and allocate their outputs per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.launch import check_device, check_dtype, check_shape, interpreting, next_pow2, require
from dsflash.plugins.mhc_boundary import splits
from dsflash.plugins.mhc_boundary.finish import finish_block, normalise_chunks, total_sumsq_x
from dsflash.plugins.mhc_boundary.kernel import (
    check_mix_inputs,
    check_site,
    launch_config,
    mhc_boundary_kernel,
)
from dsflash.plugins.mhc_boundary.reference import hc_from_mixes, n_mixes


@triton.jit
def mhc_boundary_finish_kernel(x_raw_ptr, mixes_ptr, sums_ptr, base_ptr, scale_ptr, nw_ptr, T, n_split,
                               x_ptr, pre_out, post_out, comb_out,
                               C: tl.constexpr, E: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                               ITERS: tl.constexpr, HC_EPS: tl.constexpr, RMS_EPS: tl.constexpr,
                               BLOCK_T: tl.constexpr, NORM_E: tl.constexpr, NSP: tl.constexpr):
    # TensorRT's AOT order: inputs, integer scalars, outputs. Grid (token blocks, cdiv(E, NORM_E) + 1):
    # the last program of a token block writes its coefficients, the others normalise a chunk each,
    # so the Sinkhorn epilogue and the RMSNorm run side by side.
    pid_t = tl.program_id(0)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    n_norm: tl.constexpr = (E + NORM_E - 1) // NORM_E
    chunk = tl.program_id(1)
    if chunk == n_norm:
        finish_block(pid_t, T, n_split, t64, tmask, mixes_ptr, sums_ptr, base_ptr, scale_ptr, pre_out,
                     post_out, comb_out, C, E, M, MP, ITERS, HC_EPS, RMS_EPS, BLOCK_T, NSP)
    else:
        normalise_chunks(total_sumsq_x(T, n_split, t64, tmask, sums_ptr, NSP), t64, tmask, x_raw_ptr, x_ptr,
                         nw_ptr, chunk, chunk + 1, E, RMS_EPS, NORM_E)


def finish_config(tokens_hint: int, hidden: int) -> dict:
    """Rows per program and channels per normalising program. Up to 4 rows (decode) one program
    per row block merges each row's splits in one [NSP, M] load (finish._merge_partials); from 16
    rows it adds them split by split, which suits the few splits many rows get."""
    block_t = next_pow2(tokens_hint) if tokens_hint <= 4 else 16
    return {"BLOCK_T": block_t, "NORM_E": min(next_pow2(hidden, 16), 256), "num_warps": 4}


def finish_grid(tokens, hidden: int, cfg: dict) -> tuple:
    """(token blocks, normalising programs + the coefficient program); ints or shape expressions."""
    return cdiv(tokens, cfg["BLOCK_T"]), cdiv(hidden, cfg["NORM_E"]) + 1, 1


def mhc_boundary_partials(streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, block_e: int,
                          split_target: int, block_t: int | None = None):
    """reference.mhc_boundary_partials' signature (block_t: rows per program, sweeps and tests).
    By default the TensorRT tactic the H200 ran fastest: 16-row blocks on the tensor cores up to
    64 tokens (ROWS_16), 64-row blocks beyond (ROWS_64); docs/benchmarks.md."""
    op = "MhcBoundaryPartials"
    check_mix_inputs(op, streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next)
    b, s, c, e = streams_BSCE.shape
    tokens, n_mix = b * s, n_mixes(c)
    per, n_split = splits.split_plan(tokens, e, block_e, split_target)
    new = torch.empty_like(streams_BSCE)
    x_raw = torch.empty(b, s, e, dtype=streams_BSCE.dtype, device=streams_BSCE.device)
    mixes = torch.empty(n_split, b, s, n_mix, dtype=torch.float32, device=streams_BSCE.device)
    sums = torch.empty(n_split, b, s, 2, dtype=torch.float32, device=streams_BSCE.device)
    if tokens:
        cfg = partials_config(max(tokens, 16) if block_t is None else block_t, c, e, streams_BSCE.dtype,
                              block_e)
        if interpreting():  # the identity of kernel._computed_once is inline PTX
            cfg["ONCE"] = False
        grid = (cdiv(tokens, cfg["BLOCK_T"]), n_split)
        mhc_boundary_kernel[grid](
            streams_BSCE.contiguous(), y_BSE.contiguous(), post_BSC.contiguous(), comb_BSCC.contiguous(),
            pre_BSC.contiguous(), fn_next.contiguous(), None, None, None, tokens, per, n_split, new, x_raw,
            None, None, None, mixes, sums, None, C=c, E=e, M=n_mix, ITERS=1, HC_EPS=0.0, RMS_EPS=0.0,
            NSP=1, SPLIT=True, PARTIALS_ONLY=True, **cfg)
    return new, x_raw, mixes, sums


def partials_config(tokens_hint: int, hc: int, hidden: int, dtype: torch.dtype, block_e: int) -> dict:
    """kernel.launch_config for `tokens_hint` rows with the split form's channel chunk (its NORM_E
    only sizes a finish the first node does not run)."""
    return launch_config(tokens_hint, hc, hidden, dtype) | {"BLOCK_E": block_e}


def mhc_boundary_finish(x_raw_BSE, mixes_PBSM, sums_PBS2, base_next, scale_next, norm_weight, iters: int,
                        hc_eps: float, rms_eps: float, block_t: int | None = None):
    """reference.mhc_boundary_finish's signature (block_t: rows per program, as above; by default
    one row per program up to 64 tokens, so each row's splits merge in a program of its own, and
    16-row blocks beyond)."""
    op = "MhcBoundaryFinish"
    check_shape(op, "x_raw", x_raw_BSE, (None, None, None))
    b, s, e = x_raw_BSE.shape
    check_shape(op, "mixes", mixes_PBSM, (None, b, s, None))
    n_split, n_mix = mixes_PBSM.shape[0], mixes_PBSM.shape[3]
    c = hc_from_mixes(n_mix)
    require(c in (1, 2, 4, 8), f"{op}: hc_mult {c} is not one of 1, 2, 4, 8 (the kernel tiles streams)")
    require(1 <= n_split <= splits.MAX_SPLITS, f"{op}: {n_split} splits; the kernel merges 1 to "
            f"{splits.MAX_SPLITS}")
    check_shape(op, "sums", sums_PBS2, (n_split, b, s, 2))
    check_dtype(op, "x_raw", x_raw_BSE, (torch.float32, torch.bfloat16, torch.float16))
    check_dtype(op, "mixes", mixes_PBSM, (torch.float32,))
    check_dtype(op, "sums", sums_PBS2, (torch.float32,))
    check_site(op, n_mix, e, base_next, scale_next, norm_weight, iters)
    check_device(op, x_raw=x_raw_BSE, mixes=mixes_PBSM, sums=sums_PBS2)
    tokens = b * s
    dev = x_raw_BSE.device
    x = torch.empty_like(x_raw_BSE)
    pre = torch.empty(b, s, c, dtype=torch.float32, device=dev)
    post = torch.empty_like(pre)
    comb = torch.empty(b, s, c, c, dtype=torch.float32, device=dev)
    if tokens:
        cfg = finish_config((1 if tokens <= 64 else tokens) if block_t is None else block_t, e)
        grid = finish_grid(tokens, e, cfg)
        mhc_boundary_finish_kernel[grid[:2]](
            x_raw_BSE.contiguous(), mixes_PBSM.contiguous(), sums_PBS2.contiguous(), base_next.contiguous(),
            scale_next.contiguous(), norm_weight.contiguous(), tokens, n_split, x, pre, post, comb, C=c, E=e,
            M=n_mix, MP=next_pow2(n_mix, 16), ITERS=int(iters), HC_EPS=float(hc_eps), RMS_EPS=float(rms_eps),
            NSP=next_pow2(n_split), **cfg)
    return x, pre, post, comb
