"""MhcBoundary as one Triton launch per sublayer boundary (the single-pass update of
reference.py): the residual update, the projection of the new residual onto the next site's
mixes with its sum of squares, the collapse with the carried pre, and in the epilogue the
sigmoids, Sinkhorn and the RMSNorm of the next input.

Grid: (token blocks of BLOCK_T, channel splits). Each program streams its channels in chunks of
BLOCK_E: R = post y + comb^T R_prev (rounded once to the stream dtype, as the reference),
x = sum_k pre_k R_k (rounded, stored unnormalised), and accumulates R . fn^T on the tensor
cores (tf32 for 16-bit streams, exact for fp32) with sum R^2 and sum x^2. With many tokens one
program owns whole rows (SPLIT = 0) and finishes them itself. With few tokens (decode) the
channels are split over programs so the whole GPU reads fn; the partial sums go to a workspace
by atomics and the last program of a token block (a counter) finishes the rows and clears the
workspace for the next launch, so a boundary stays one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.launch import LauncherBase, check_device, check_dtype, check_shape, next_pow2, require


@triton.jit
def _next_coefficients(acc, sumsq_r, t, tmask, base_ptr, scale_ptr, pre_out, post_out, comb_out,
                       E: tl.constexpr, ITERS: tl.constexpr, HC_EPS: tl.constexpr, RMS_EPS: tl.constexpr,
                       C: tl.constexpr, M: tl.constexpr, MP: tl.constexpr):
    """pre, post (sigmoids) and comb (Sinkhorn) of the next site for the rows t."""
    mixes = acc * tl.rsqrt(sumsq_r / (C * E) + RMS_EPS)[:, None]
    m = tl.arange(0, MP)
    base = tl.load(base_ptr + m, mask=m < M, other=0.0).to(tl.float32)
    s_pre = tl.load(scale_ptr + 0).to(tl.float32)
    s_post = tl.load(scale_ptr + 1).to(tl.float32)
    s_comb = tl.load(scale_ptr + 2).to(tl.float32)
    a = tl.arange(0, C)
    # pick columns out of the [BLOCK_T, MP] mixes with one-hot selections (C and M are tiny)
    sel_pre = (m[None, :] == a[:, None]).to(tl.float32)
    sel_post = (m[None, :] == (C + a)[:, None]).to(tl.float32)
    pre = tl.sum(mixes[:, None, :] * sel_pre[None], axis=2) * s_pre
    pre += tl.sum(base[None] * sel_pre, 1)[None]
    post = tl.sum(mixes[:, None, :] * sel_post[None], axis=2) * s_post
    post += tl.sum(base[None] * sel_post, 1)[None]
    pre = tl.sigmoid(pre) + HC_EPS
    post = 2.0 * tl.sigmoid(post)
    col = 2 * C + a[:, None, None] * C + a[None, :, None]
    sel_comb = (m[None, None, :] == col).to(tl.float32)  # [C, C, MP]
    logits = tl.sum(mixes[:, None, None, :] * sel_comb[None], axis=3) * s_comb
    logits += tl.sum(base[None, None, :] * sel_comb, axis=2)[None]
    ex = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = ex / tl.sum(ex, axis=2)[:, :, None] + HC_EPS
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + HC_EPS)
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + HC_EPS)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + HC_EPS)
    tc = t[:, None] * C + a[None, :]
    tl.store(pre_out + tc, pre, mask=tmask[:, None])
    tl.store(post_out + tc, post, mask=tmask[:, None])
    tcc = t[:, None, None] * (C * C) + a[None, :, None] * C + a[None, None, :]
    tl.store(comb_out + tcc, comb, mask=tmask[:, None, None])


@triton.jit
def _normalise_rows(sumsq_x, t, tmask, x_ptr, nw_ptr, E: tl.constexpr, RMS_EPS: tl.constexpr,
                    BLOCK_E: tl.constexpr):
    """x <- RMSNorm(x) * w over whole rows this program wrote itself (tiles of BLOCK_T rows)."""
    rstd_x = tl.rsqrt(sumsq_x / E + RMS_EPS)
    for e0 in range(0, E, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        m2 = tmask[:, None] & (e < E)[None, :]
        ptrs = x_ptr + t[:, None] * E + e[None, :]
        x = tl.load(ptrs, mask=m2, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + e, mask=e < E, other=0.0).to(tl.float32)
        tl.store(ptrs, (x * rstd_x[:, None] * w[None, :]).to(x_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _normalise_rows_flat(rstd_ptr, t0, n_rows, x_ptr, nw_ptr, E: tl.constexpr, FLAT: tl.constexpr):
    """The same over rows other programs wrote (split path), as one flat run of n_rows * E
    elements so one token is a few wide steps; rstd per row comes from memory (rstd_ptr[2 * row])
    and x through L2 (.cg), never a stale L1 line."""
    for i0 in range(0, n_rows * E, FLAT):
        i = i0 + tl.arange(0, FLAT)
        ok = i < n_rows * E
        row = t0 + i // E
        e = i % E
        r = tl.load(rstd_ptr + row * 2, mask=ok, other=0.0, cache_modifier=".cg")
        x = tl.load(x_ptr + row * E + e, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        w = tl.load(nw_ptr + e, mask=ok, other=0.0).to(tl.float32)
        tl.store(x_ptr + row * E + e, (x * r * w).to(x_ptr.dtype.element_ty), mask=ok)


@triton.jit
def mhc_boundary_kernel(streams_ptr, y_ptr, post_ptr, comb_ptr, pre_ptr, fn_ptr, base_ptr, scale_ptr,
                        nw_ptr, T, e_per_split, n_split, new_ptr, x_ptr, pre_out, post_out, comb_out,
                        ws_acc, ws_sq, counter,
                        C: tl.constexpr, E: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                        ITERS: tl.constexpr, HC_EPS: tl.constexpr, RMS_EPS: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SPLIT: tl.constexpr,
                        IEEE: tl.constexpr):
    # TensorRT's AOT order: inputs, integer scalars, outputs. The workspace comes last: the
    # TensorRT build compiles SPLIT = 0, which never touches it.
    pid_t = tl.program_id(0)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t64 = t.to(tl.int64)
    m = tl.arange(0, MP)
    acc = tl.zeros([BLOCK_T, MP], dtype=tl.float32)
    sumsq_r = tl.zeros([BLOCK_T], dtype=tl.float32)
    sumsq_x = tl.zeros([BLOCK_T], dtype=tl.float32)
    e_lo = tl.program_id(1) * e_per_split
    e_hi = tl.minimum(e_lo + e_per_split, E)
    for e0 in range(e_lo, e_hi, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        emask = e < e_hi
        m2 = tmask[:, None] & emask[None, :]
        y = tl.load(y_ptr + t64[:, None] * E + e[None, :], mask=m2, other=0.0).to(tl.float32)
        x_acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        # one output stream at a time keeps every tile 2-D; the C input tiles are re-read from L1
        for k in tl.static_range(C):
            post_k = tl.load(post_ptr + t64 * C + k, mask=tmask, other=0.0).to(tl.float32)
            new_k = post_k[:, None] * y
            for j in tl.static_range(C):
                rj = tl.load(streams_ptr + (t64[:, None] * C + j) * E + e[None, :], mask=m2, other=0.0)
                c_jk = tl.load(comb_ptr + t64 * (C * C) + j * C + k, mask=tmask, other=0.0).to(tl.float32)
                new_k += c_jk[:, None] * rj.to(tl.float32)  # comb applied transposed
            new_k = new_k.to(new_ptr.dtype.element_ty)  # rounded once, as the reference
            tl.store(new_ptr + (t64[:, None] * C + k) * E + e[None, :], new_k, mask=m2)
            nf = new_k.to(tl.float32)
            sumsq_r += tl.sum(nf * nf, axis=1)
            pre_k = tl.load(pre_ptr + t64 * C + k, mask=tmask, other=0.0).to(tl.float32)
            x_acc += pre_k[:, None] * nf
            # fn[m, k*E + e] as a [BLOCK_E, MP] tile of fn^T
            fn_t = tl.load(fn_ptr + m[None, :] * (C * E) + k * E + e[:, None],
                           mask=(m < M)[None, :] & emask[:, None], other=0.0).to(tl.float32)
            if IEEE:
                acc += tl.dot(nf, fn_t, input_precision="ieee")
            else:
                acc += tl.dot(nf, fn_t, input_precision="tf32")
        x = x_acc.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + t64[:, None] * E + e[None, :], x, mask=m2)
        xf = x.to(tl.float32)
        sumsq_x += tl.sum(xf * xf, axis=1)
    if SPLIT:
        mm = tmask[:, None] & (m < M)[None, :]
        tl.atomic_add(ws_acc + t64[:, None] * MP + m[None, :], acc, mask=mm)
        tl.atomic_add(ws_sq + t64 * 2, sumsq_r, mask=tmask)
        tl.atomic_add(ws_sq + t64 * 2 + 1, sumsq_x, mask=tmask)
        tl.debug_barrier()  # every thread's partials are issued before the counter moves
        done = tl.atomic_add(counter + pid_t, 1)  # acq_rel at GPU scope
        if done == n_split - 1:
            acc = tl.load(ws_acc + t64[:, None] * MP + m[None, :], mask=mm, other=0.0, cache_modifier=".cg")
            sumsq_r = tl.load(ws_sq + t64 * 2, mask=tmask, other=0.0, cache_modifier=".cg")
            sumsq_x = tl.load(ws_sq + t64 * 2 + 1, mask=tmask, other=0.0, cache_modifier=".cg")
            tl.store(ws_acc + t64[:, None] * MP + m[None, :], tl.zeros_like(acc), mask=mm)
            tl.store(ws_sq + t64 * 2, tl.rsqrt(sumsq_x / E + RMS_EPS), mask=tmask)  # rstd for the flat pass
            tl.store(ws_sq + t64 * 2 + 1, tl.zeros_like(sumsq_x), mask=tmask)
            tl.store(counter + pid_t, 0)
            _next_coefficients(acc, sumsq_r, t64, tmask, base_ptr, scale_ptr, pre_out, post_out, comb_out,
                               E, ITERS, HC_EPS, RMS_EPS, C, M, MP)
            tl.debug_barrier()  # the rstd values are written before any thread reads them back
            t0 = pid_t.to(tl.int64) * BLOCK_T
            _normalise_rows_flat(ws_sq, t0, tl.minimum(BLOCK_T, T - t0), x_ptr, nw_ptr, E, 2048)
            tl.debug_barrier()
            tl.store(ws_sq + t64 * 2, tl.zeros_like(sumsq_x), mask=tmask)  # cleared for the next launch
    else:
        tl.debug_barrier()  # this program's unnormalised x rows are written before it rereads them
        _next_coefficients(acc, sumsq_r, t64, tmask, base_ptr, scale_ptr, pre_out, post_out, comb_out,
                           E, ITERS, HC_EPS, RMS_EPS, C, M, MP)
        _normalise_rows(sumsq_x, t64, tmask, x_ptr, nw_ptr, E, RMS_EPS, BLOCK_E)


def _check(streams, y, post, comb, pre, fn, base, scale, norm_weight, iters):
    op = "MhcBoundary"
    check_shape(op, "streams", streams, (None, None, None, None))
    b, s, c, e = streams.shape
    require(c in (1, 2, 4, 8), f"{op}: hc_mult {c} is not one of 1, 2, 4, 8 (the kernel tiles streams)")
    n_mix = (2 + c) * c
    for name, t, shp in (("y", y, (b, s, e)), ("post", post, (b, s, c)), ("comb", comb, (b, s, c, c)),
                         ("pre", pre, (b, s, c)), ("fn", fn, (n_mix, c * e)), ("base", base, (n_mix,)),
                         ("scale", scale, (3,)), ("norm_weight", norm_weight, (e,))):
        check_shape(op, name, t, shp)
    check_dtype(op, "streams", streams, (torch.float32, torch.bfloat16, torch.float16))
    require(y.dtype == streams.dtype, f"{op}: y is {y.dtype}, streams are {streams.dtype}")
    require(iters >= 1, f"{op}: sinkhorn iters {iters} < 1")
    check_device(op, streams=streams, y=y, post=post, comb=comb, pre=pre, fn=fn, base=base, scale=scale,
                 norm_weight=norm_weight)


class MhcBoundaryLauncher(LauncherBase):
    """Holds the self-clearing workspace of the split (few-token) path, so each call is exactly
    one kernel launch. One instance per device/stream; calls on it must not overlap."""

    def _workspace(self, device, rows: int, mp: int, blocks: int):
        key = (device, mp)
        ws = self._ws.get(key)
        if ws is None or ws[0].shape[0] < rows or ws[2].numel() < blocks:
            ws = (torch.zeros(rows, mp, dtype=torch.float32, device=device),
                  torch.zeros(rows, 2, dtype=torch.float32, device=device),
                  torch.zeros(blocks, dtype=torch.int32, device=device))
            self._ws[key] = ws
        return ws

    def __call__(self, streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, base_next,
                 scale_next, norm_weight, iters: int, hc_eps: float, rms_eps: float,
                 n_split: int | None = None):
        _check(streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, base_next, scale_next,
               norm_weight, iters)
        b, s, c, e = streams_BSCE.shape
        tokens, n_mix = b * s, (2 + c) * c
        dev = streams_BSCE.device
        new = torch.empty_like(streams_BSCE)
        x = torch.empty(b, s, e, dtype=streams_BSCE.dtype, device=dev)
        pre = torch.empty(b, s, c, dtype=torch.float32, device=dev)
        post = torch.empty_like(pre)
        comb = torch.empty(b, s, c, c, dtype=torch.float32, device=dev)
        if tokens == 0:
            return new, x, pre, post, comb
        cfg = launch_config(tokens, c, e, streams_BSCE.dtype) | self._overrides
        block_e, block_t = cfg["BLOCK_E"], cfg["BLOCK_T"]
        t_blocks = triton.cdiv(tokens, block_t)
        if n_split is None:  # split channels only until the grid covers the GPU twice
            n_split = max(1, min(triton.cdiv(e, block_e), triton.cdiv(2 * self._sms(dev), t_blocks)))
        e_per = triton.cdiv(triton.cdiv(e, n_split), block_e) * block_e
        n_split = triton.cdiv(e, e_per)
        ws_acc, ws_sq, counter = self._workspace(dev, tokens if n_split > 1 else 1, cfg["MP"],
                                                 t_blocks if n_split > 1 else 1)
        f = [t.contiguous() for t in (streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next,
                                      base_next, scale_next, norm_weight)]
        mhc_boundary_kernel[(t_blocks, n_split)](
            *f, tokens, e_per, n_split, new, x, pre, post, comb, ws_acc, ws_sq, counter, C=c, E=e, M=n_mix,
            ITERS=int(iters), HC_EPS=float(hc_eps), RMS_EPS=float(rms_eps), SPLIT=n_split > 1, **cfg)
        return new, x, pre, post, comb


def launch_config(tokens: int, hc: int, hidden: int, dtype: torch.dtype) -> dict:
    """Block sizes and warps, shared by the JIT launch and the AOT compile (trt.py)."""
    # H200 (docs/benchmarks.md): decode sizes run fastest with 32-channel chunks and 4 warps; for
    # many tokens the sweep's fastest setting (32 x 32, 4 warps) failed the 300-token check on the
    # GPU, so many tokens keep the setting verified there (64-channel chunks, 8 warps)
    few = tokens <= 64
    return dict(BLOCK_T=16 if few else 32, BLOCK_E=min(32 if few else 64, next_pow2(hidden, 16)),
                MP=next_pow2((2 + hc) * hc, 16), IEEE=dtype == torch.float32, num_warps=4 if few else 8)


def mhc_boundary(streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, base_next, scale_next,
                 norm_weight, iters: int, hc_eps: float, rms_eps: float):
    """-> (new streams, next sublayer input, next pre, next post, next comb), as the reference.
    A fresh workspace per call (a zero fill, so two launches); hold an MhcBoundaryLauncher for one."""
    return MhcBoundaryLauncher()(streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, base_next,
                                 scale_next, norm_weight, iters, hc_eps, rms_eps)
