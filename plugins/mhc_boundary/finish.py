"""MhcBoundary's finish (kernel.py runs the channel loop): what a token block does once its
channel sums are complete. The next site's coefficients from the projection (sigmoids, and the
Sinkhorn of the comb logits), and the RMSNorm of the next input x, which the channel loop stored
unnormalised. Four ways a block gets there: one program owned whole rows; the last of the block's
channel splits merges their partials from the workspace (a counter) and finishes alone;
the splits meet at a barrier, then each finishes some rows (finish_block on one row at a time)
and normalises its own chunks (normalise_chunks; a cooperative launch); or, in TensorRT, a
cluster of CTAs exchanges its sums through the outputs (cluster_finish). The split form's second
node (split_form.py) runs finish_block and normalise_chunks as a kernel of their own.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_site(base_ptr, scale_ptr, M: tl.constexpr, MP: tl.constexpr):
    """The next site's biases and the three scales (loaded early, so their latency overlaps)."""
    m = tl.arange(0, MP)
    base = tl.load(base_ptr + m, mask=m < M, other=0.0).to(tl.float32)
    return (base, tl.load(scale_ptr + 0).to(tl.float32), tl.load(scale_ptr + 1).to(tl.float32),
            tl.load(scale_ptr + 2).to(tl.float32))


@triton.jit
def next_coefficients(acc, sumsq_r, t, tmask, base, s_pre, s_post, s_comb, pre_out, post_out, comb_out,
                       E: tl.constexpr, ITERS: tl.constexpr, HC_EPS: tl.constexpr, RMS_EPS: tl.constexpr,
                       C: tl.constexpr, M: tl.constexpr, MP: tl.constexpr):
    """pre, post (sigmoids) and comb (Sinkhorn) of the next site for the rows t. The scaled and
    biased mixes go through the outputs' own rows (written, then read back as [rows, C] and
    [rows, C, C] after a barrier): picking the columns out of the [rows, MP] tile in registers
    with one-hot sums built a [rows, C, C, MP] product, 256 values per thread at 64 rows, which
    set the whole kernel's register count (255, with spills; ptxas, sm_90a)."""
    mixes = acc * tl.rsqrt(sumsq_r / (C * E) + RMS_EPS)[:, None]
    m = tl.arange(0, MP)
    scale = tl.where(m < C, s_pre, tl.where(m < 2 * C, s_post, s_comb))
    z = mixes * scale[None, :] + base[None, :]
    rows = tmask[:, None]
    tm = t[:, None]
    tl.store(pre_out + tm * C + m[None, :], z, mask=rows & (m < C)[None, :])
    tl.store(post_out + tm * C + (m[None, :] - C), z, mask=rows & ((m >= C) & (m < 2 * C))[None, :])
    tl.store(comb_out + tm * (C * C) + (m[None, :] - 2 * C), z, mask=rows & ((m >= 2 * C) & (m < M))[None, :])
    tl.debug_barrier()  # the block's raw values are written (and visible to it) before it reads them
    a = tl.arange(0, C)
    tc = t[:, None] * C + a[None, :]
    pre = tl.sigmoid(tl.load(pre_out + tc, mask=rows, other=0.0, cache_modifier=".cg")) + HC_EPS
    post = 2.0 * tl.sigmoid(tl.load(post_out + tc, mask=rows, other=0.0, cache_modifier=".cg"))
    if t.shape[0] >= 16:
        # Sinkhorn on C * C [rows] vectors (_sinkhorn). H200 (session 13, the kernel without the
        # barrier): 16 tokens 28.6 -> 24.3 us, 64 tokens 23.0 -> 20.3 us, 300 tokens 46.9 -> 44.9;
        # at 1 and 4 tokens the [rows, C, C] tile below was as fast or faster (8.4 against 8.6 us,
        # 17.6 against 18.3 us in a first run)
        logits = ()
        for jk in tl.static_range(C * C):
            raw = tl.load(comb_out + t * (C * C) + jk, mask=tmask, other=0.0, cache_modifier=".cg")
            logits = logits + (raw,)
        comb = _sinkhorn(logits, C, ITERS, HC_EPS)
        tl.debug_barrier()  # every thread has read the raw values before any is overwritten
        for jk in tl.static_range(C * C):
            tl.store(comb_out + t * (C * C) + jk, comb[jk], mask=tmask)
    else:
        tcc = t[:, None, None] * (C * C) + a[None, :, None] * C + a[None, None, :]
        logits = tl.load(comb_out + tcc, mask=tmask[:, None, None], other=0.0, cache_modifier=".cg")
        ex = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
        comb = ex / tl.sum(ex, axis=2)[:, :, None] + HC_EPS
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + HC_EPS)
        for _ in range(ITERS - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + HC_EPS)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + HC_EPS)
        tl.debug_barrier()  # every thread has read the raw values before any is overwritten
        tl.store(comb_out + tcc, comb, mask=tmask[:, None, None])
    tl.store(pre_out + tc, pre, mask=rows)
    tl.store(post_out + tc, post, mask=rows)


@triton.jit
def _divide_rows(c, C: tl.constexpr, HC_EPS: tl.constexpr):
    """c[j, k] / (sum_k c[j, k] + eps) for a C x C matrix held as C * C vectors (row-major)."""
    out = ()
    for j in tl.static_range(C):
        total = c[j * C]
        for k in tl.static_range(1, C):
            total += c[j * C + k]
        for k in tl.static_range(C):
            out = out + (c[j * C + k] / (total + HC_EPS),)
    return out


@triton.jit
def _divide_columns(c, C: tl.constexpr, HC_EPS: tl.constexpr):
    """c[j, k] / (sum_j c[j, k] + eps), as _divide_rows."""
    totals = ()
    for k in tl.static_range(C):
        total = c[k]
        for j in tl.static_range(1, C):
            total += c[j * C + k]
        totals = totals + (total + HC_EPS,)
    out = ()
    for jk in tl.static_range(C * C):
        out = out + (c[jk] / totals[jk % C],)
    return out


@triton.jit
def _sinkhorn(logits, C: tl.constexpr, ITERS: tl.constexpr, HC_EPS: tl.constexpr):
    """reference.sinkhorn for each row's C x C logits, held as C * C [rows] vectors (a tuple,
    row-major): every sum is one thread's own additions, where a [rows, C, C] tile of 16 or more
    rows spreads each matrix over several threads (shuffles in each of the 2 * ITERS sums)."""
    ex = ()
    for j in tl.static_range(C):
        top = logits[j * C]
        for k in tl.static_range(1, C):
            top = tl.maximum(top, logits[j * C + k])
        for k in tl.static_range(C):
            ex = ex + (tl.exp(logits[j * C + k] - top),)
    comb = _divide_rows(ex, C, 0.0)
    eps = ()
    for jk in tl.static_range(C * C):
        eps = eps + (comb[jk] + HC_EPS,)
    comb = _divide_columns(eps, C, HC_EPS)
    for _ in range(ITERS - 1):
        comb = _divide_columns(_divide_rows(comb, C, HC_EPS), C, HC_EPS)
    return comb


@triton.jit
def normalise_rows(sumsq_x, t, tmask, x_ptr, nw_ptr, E: tl.constexpr, RMS_EPS: tl.constexpr,
                    NORM_E: tl.constexpr):
    """x <- RMSNorm(x) * w over whole rows, in [BLOCK_T, NORM_E] tiles. Read through L2 (.cg): on
    the split path other programs wrote these rows. Tiles, not whole rows: a [E] row vector per
    thread group (w and x of 8K channels) held 252 registers across the whole kernel (ptxas,
    sm_90a), two programs per SM where the channel loop alone needs 167."""
    rstd_x = tl.rsqrt(sumsq_x / E + RMS_EPS)
    # pipelined (3 stages): as a plain loop every tile waited out its load, in the tail where one
    # program per SM is left (H200, 8,192 tokens, session 8: 469 -> 453 us)
    for e0 in tl.range(0, E, NORM_E, num_stages=3):
        e = e0 + tl.arange(0, NORM_E)
        m2 = tmask[:, None] & (e < E)[None, :]
        ptrs = x_ptr + t[:, None] * E + e[None, :]
        x = tl.load(ptrs, mask=m2, other=0.0, cache_modifier=".cg").to(tl.float32)
        w = tl.load(nw_ptr + e, mask=e < E, other=0.0).to(tl.float32)
        tl.store(ptrs, (x * rstd_x[:, None] * w[None, :]).to(x_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _merge_partials(pid_t, T, n_split, t64, tmask, ws_acc, ws_sq, M: tl.constexpr, MP: tl.constexpr,
                    BLOCK_T: tl.constexpr, NSP: tl.constexpr):
    """Split path: the splits' partial sums of a token block added in a fixed order (deterministic,
    unlike float atomics; through L2) -> (projection [rows, MP], sum R^2, sum x^2)."""
    m = tl.arange(0, MP)
    acc = tl.zeros([BLOCK_T, MP], dtype=tl.float32)
    sumsq_r = tl.zeros([BLOCK_T], dtype=tl.float32)
    sumsq_x = tl.zeros([BLOCK_T], dtype=tl.float32)
    if BLOCK_T < 16:  # decode: few rows, up to 256 splits; one [NSP, MP] load per row
        sp = tl.arange(0, NSP)
        tt = tl.arange(0, BLOCK_T)
        t0 = pid_t.to(tl.int64) * BLOCK_T
        ok = sp < n_split
        for i in range(tl.minimum(BLOCK_T, T - t0)):
            slot = sp.to(tl.int64) * T + t0 + i
            part = tl.load(ws_acc + slot[:, None] * M + m[None, :], mask=ok[:, None] & (m < M)[None, :],
                           other=0.0, cache_modifier=".cg")
            sq_r = tl.load(ws_sq + slot * 2, mask=ok, other=0.0, cache_modifier=".cg")
            sq_x = tl.load(ws_sq + slot * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            here = tt == i
            acc = tl.where(here[:, None], tl.sum(part, axis=0)[None, :], acc)
            sumsq_r = tl.where(here, tl.sum(sq_r, axis=0), sumsq_r)
            sumsq_x = tl.where(here, tl.sum(sq_x, axis=0), sumsq_x)
    else:  # prefill: many rows, few splits; one [BLOCK_T, MP] load per split, in split order
        mm = tmask[:, None] & (m < M)[None, :]
        slot = t64  # split sp's slots of these rows: sp * T + t, in int64
        for _ in range(n_split):
            acc += tl.load(ws_acc + slot[:, None] * M + m[None, :], mask=mm, other=0.0, cache_modifier=".cg")
            sumsq_r += tl.load(ws_sq + slot * 2, mask=tmask, other=0.0, cache_modifier=".cg")
            sumsq_x += tl.load(ws_sq + slot * 2 + 1, mask=tmask, other=0.0, cache_modifier=".cg")
            slot += T
    return acc, sumsq_r, sumsq_x


@triton.jit
def finish_block(pid_t, T, n_split, t64, tmask, ws_acc, ws_sq, base_ptr, scale_ptr, pre_out, post_out,
                  comb_out, C: tl.constexpr, E: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                  ITERS: tl.constexpr, HC_EPS: tl.constexpr, RMS_EPS: tl.constexpr, BLOCK_T: tl.constexpr,
                  NSP: tl.constexpr):
    """Split path, one program per token block: merge the partials, write the next coefficients.
    -> the rows' sum of x^2."""
    base, s_pre, s_post, s_comb = load_site(base_ptr, scale_ptr, M, MP)
    acc, sumsq_r, sumsq_x = _merge_partials(pid_t, T, n_split, t64, tmask, ws_acc, ws_sq, M, MP, BLOCK_T, NSP)
    next_coefficients(acc, sumsq_r, t64, tmask, base, s_pre, s_post, s_comb, pre_out, post_out, comb_out,
                       E, ITERS, HC_EPS, RMS_EPS, C, M, MP)
    return sumsq_x


@triton.jit
def normalise_chunks(sumsq_x, t64, tmask, src_ptr, dst_ptr, nw_ptr, c_lo, c_hi, E: tl.constexpr,
                      RMS_EPS: tl.constexpr, BLOCK_E: tl.constexpr):
    """dst <- RMSNorm(src) * w over the chunks [c_lo, c_hi) of channels: the barrier path's own
    chunks (src = dst = x), or the split form's finish (src the first node's unnormalised x)."""
    rstd_x = tl.rsqrt(sumsq_x / E + RMS_EPS)
    for c in range(c_lo, c_hi):
        e = c * BLOCK_E + tl.arange(0, BLOCK_E)
        emask = e < E
        m2 = tmask[:, None] & emask[None, :]
        at = t64[:, None] * E + e[None, :]
        x = tl.load(src_ptr + at, mask=m2, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + e, mask=emask, other=0.0).to(tl.float32)
        tl.store(dst_ptr + at, (x * rstd_x[:, None] * w[None, :]).to(dst_ptr.dtype.element_ty), mask=m2)


@triton.jit
def total_sumsq_x(T, n_split, t64, tmask, ws_sq, NSP: tl.constexpr):
    """Every split's sum of x^2 for the rows t, added in the same order in every program."""
    sp = tl.arange(0, NSP)
    slot = sp[None, :].to(tl.int64) * T + t64[:, None]
    part = tl.load(ws_sq + slot * 2 + 1, mask=tmask[:, None] & (sp < n_split)[None, :], other=0.0,
                   cache_modifier=".cg")
    return tl.sum(part, axis=1)


@triton.jit
def _cluster_sync(token):
    """Every thread of every CTA of the cluster arrives (release) and waits (acquire): the global
    stores before it are visible to the cluster's loads after it (PTX barrier.cluster). Returns an
    opaque 0 (depends on `token`, an int32) that the loads after it add to their offsets, so no
    compiler pass can move them above it."""
    return tl.inline_asm_elementwise(
        "barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;\n\tmov.u32 $0, 0;",
        "=r,r", [token], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cluster_finish(acc, sumsq_r, sumsq_x, rank, c_lo, c_hi, t64, tmask, pre, new_ptr, x_ptr, nw_ptr,
                    base_ptr, scale_ptr, pre_out, post_out, comb_out, C: tl.constexpr, E: tl.constexpr,
                    M: tl.constexpr, MP: tl.constexpr, ITERS: tl.constexpr, HC_EPS: tl.constexpr,
                    RMS_EPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, PER: tl.constexpr,
                    CLUSTER: tl.constexpr):
    """Cluster path (TensorRT, few tokens): the CLUSTER CTAs of a cluster hold one token block's
    partial sums over their channels. With no workspace to exchange them in, each CTA writes its
    M + 2 partials (fp32) over the first words of its own x columns; after a cluster barrier every
    CTA sums all of them in rank order (the same totals everywhere, deterministic), and after a
    second one (all partials read) rewrites its x columns normalised: x again from the new streams
    it stored (the same products and rounding as _mix_chunk). Rank 0 writes the coefficients."""
    m = tl.arange(0, MP)
    mm = tmask[:, None] & (m < M)[None, :]
    own = (x_ptr + t64 * E + c_lo * BLOCK_E).to(tl.pointer_type(tl.float32))
    tl.debug_barrier()  # the CTA's x stores are done before the partials overwrite some of them
    tl.store(own[:, None] + m[None, :], acc, mask=mm)
    tl.store(own + M, sumsq_r, mask=tmask)
    tl.store(own + M + 1, sumsq_x, mask=tmask)
    zero = _cluster_sync(rank)
    acc = tl.zeros([BLOCK_T, MP], dtype=tl.float32)
    sumsq_r = tl.zeros([BLOCK_T], dtype=tl.float32)
    sumsq_x = tl.zeros([BLOCK_T], dtype=tl.float32)
    for r in tl.static_range(CLUSTER):
        part = (x_ptr + t64 * E + (r * PER * BLOCK_E + zero)).to(tl.pointer_type(tl.float32))
        acc += tl.load(part[:, None] + m[None, :], mask=mm, other=0.0, cache_modifier=".cg")
        sumsq_r += tl.load(part + M, mask=tmask, other=0.0, cache_modifier=".cg")
        sumsq_x += tl.load(part + M + 1, mask=tmask, other=0.0, cache_modifier=".cg")
    zero = _cluster_sync(zero)
    rstd_x = tl.rsqrt(sumsq_x / E + RMS_EPS)
    for c in range(c_lo, c_hi):
        e = c * BLOCK_E + zero + tl.arange(0, BLOCK_E)
        emask = e < E
        m2 = tmask[:, None] & emask[None, :]
        x_acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for k in tl.static_range(C):
            nf = tl.load(new_ptr + (t64[:, None] * C + k) * E + e[None, :], mask=m2, other=0.0,
                         cache_modifier=".cg").to(tl.float32)
            x_acc += pre[k][:, None] * nf
        x = x_acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(nw_ptr + e, mask=emask, other=0.0).to(tl.float32)
        normed = (x * rstd_x[:, None] * w[None, :]).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + t64[:, None] * E + e[None, :], normed, mask=m2)
    if rank == 0:
        base, s_pre, s_post, s_comb = load_site(base_ptr, scale_ptr, M, MP)
        next_coefficients(acc, sumsq_r, t64, tmask, base, s_pre, s_post, s_comb, pre_out, post_out, comb_out,
                           E, ITERS, HC_EPS, RMS_EPS, C, M, MP)
