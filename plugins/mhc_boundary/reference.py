"""MhcBoundary reference: one single-pass mHC sublayer boundary (ARCHITECTURE.md §4.1, §8).

Given the residual R_prev [B,S,C,E], the finished sublayer's output y [B,S,E], its post [B,S,C]
and comb [B,S,C,C], and the pre it handed on [B,S,C] (the shift of V4.1):
  R    = post (x) y + comb^T R_prev                      (summed in fp32, rounded once)
  x    = RMSNorm_next(sum_i pre_i R_i)                   (the next sublayer's input)
  next = coefficients of the next site from R: mixes = (vec(R) . fn^T) * rsqrt(mean R^2 + eps)
         pre' = sigmoid(mixes[:C] s0 + b) + hc_eps, post' = 2 sigmoid(...), comb' = Sinkhorn(...)
The rms of R is applied after the projection (the fused kernel's order).
"""

from __future__ import annotations

import math

import torch

from dsflash.plugins.dtypes import cast, f32
from dsflash.plugins.mhc_boundary.splits import channel_ranges, split_plan


def sinkhorn(logits_BSCC: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, then alternate column / row normalisation (iters steps in all)."""
    c = torch.softmax(f32(logits_BSCC), dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def split_mixes(mixes_BSM: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                iters: int, hc_eps: float, *,
                sinkhorn_fn=sinkhorn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(2+C)*C raw mixes -> (pre [B,S,C], post [B,S,C], comb [B,S,C,C]) in fp32. `sinkhorn_fn`:
    sinkhorn, or while exporting its one-node form (sinkhorn_node.py), the same maths."""
    base, scale = f32(base), f32(scale)
    pre = torch.sigmoid(mixes_BSM[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(mixes_BSM[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = mixes_BSM[..., 2 * hc:] * scale[2] + base[2 * hc:]
    return pre, post, sinkhorn_fn(logits.unflatten(-1, (hc, hc)), iters, hc_eps)


def hc_collapse(streams_BSCE: torch.Tensor, pre_BSC: torch.Tensor) -> torch.Tensor:
    return cast((pre_BSC.unsqueeze(-1) * f32(streams_BSCE)).sum(-2), streams_BSCE.dtype)


def hc_post(streams_BSCE: torch.Tensor, y_BSE: torch.Tensor, post_BSC: torch.Tensor,
            comb_BSCC: torch.Tensor) -> torch.Tensor:
    """R'_k = post_k y + sum_j comb[j,k] R_j (comb applied transposed), fp32 sum, one rounding."""
    mixed = torch.einsum("bsjk,bsje->bske", comb_BSCC, f32(streams_BSCE))
    return cast(post_BSC.unsqueeze(-1) * f32(y_BSE).unsqueeze(-2) + mixed, streams_BSCE.dtype)


def mhc_boundary(streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, base_next, scale_next,
                 norm_weight, iters: int, hc_eps: float, rms_eps: float):
    """-> (new streams, next sublayer input, next pre, next post, next comb)."""
    return boundary_with_sinkhorn(sinkhorn, streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next,
                                  base_next, scale_next, norm_weight, iters, hc_eps, rms_eps)


def boundary_with_sinkhorn(sinkhorn_fn, streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, base_next,
                           scale_next, norm_weight, iters: int, hc_eps: float, rms_eps: float):
    """mhc_boundary with another Sinkhorn of the same maths (OpSet.sinkhorn: one node while
    exporting, sinkhorn_node.py); the kernels' signature stays the reference's."""
    new = hc_post(streams_BSCE, y_BSE, post_BSC, comb_BSCC)
    flat = f32(new).flatten(-2)
    x_raw = hc_collapse(new, pre_BSC)
    x = f32(x_raw)
    sums = torch.stack((flat.pow(2).sum(-1), x.pow(2).sum(-1)), dim=-1)
    return (new, *finish_from_sums(flat @ f32(fn_next).t(), sums, x_raw, base_next, scale_next, norm_weight,
                                   new.shape[-2], iters, hc_eps, rms_eps, sinkhorn_fn=sinkhorn_fn))


def finish_from_sums(mixes_BSM, sums_BS2, x_raw_BSE, base_next, scale_next, norm_weight, hc: int, iters: int,
                     hc_eps: float, rms_eps: float, *, sinkhorn_fn=sinkhorn):
    """The boundary's finish from its complete sums (the one-node op's, or the split form's added
    up): the mixes scaled by the rms of R, the next coefficients, and RMSNorm of x.
    sums_BS2: (sum R^2 over the C * E values, sum x^2 over E). -> (x, pre, post, comb)."""
    e = x_raw_BSE.shape[-1]
    rstd = torch.rsqrt(sums_BS2[..., :1] / (hc * e) + rms_eps)
    pre, post, comb = split_mixes(mixes_BSM * rstd, base_next, scale_next, hc, iters, hc_eps,
                                  sinkhorn_fn=sinkhorn_fn)
    x = f32(x_raw_BSE) * torch.rsqrt(sums_BS2[..., 1:] / e + rms_eps) * f32(norm_weight)
    return cast(x, x_raw_BSE.dtype), pre, post, comb


def shape(streams, y, post, comb, pre, fn, base, scale, norm_weight, iters, hc_eps, rms_eps):
    b, s, c, e = streams
    return [tuple(streams), (b, s, e), (b, s, c), (b, s, c), (b, s, c, c)]


def mhc_boundary_partials(streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, block_e: int,
                          split_target: int):
    """The split form's first half (decoder_step graphs; splits.py says which channels split p
    holds): the new residual R and the collapse x = sum_k pre_k R_k, both rounded to the stream
    dtype as in mhc_boundary, x not yet normalised; per split p its channels' share of the
    projection vec(R) . fn^T and of sum R^2 and sum x^2.
    -> (new [B,S,C,E], x_raw [B,S,E], mixes [P,B,S,M], sums [P,B,S,2]); the partials in fp32."""
    new = hc_post(streams_BSCE, y_BSE, post_BSC, comb_BSCC)
    x_raw = hc_collapse(new, pre_BSC)
    b, s, c, e = new.shape
    per, n_split = split_plan(b * s, e, block_e, split_target)
    r, x, fn = f32(new), f32(x_raw), f32(fn_next).view(-1, c, e)
    mixes, sums = [], []
    for lo, hi in channel_ranges(e, block_e, per, n_split):
        part = r[..., lo:hi]
        mixes.append(part.flatten(-2) @ fn[:, :, lo:hi].flatten(-2).t())
        sums.append(torch.stack((part.pow(2).sum((-2, -1)), x[..., lo:hi].pow(2).sum(-1)), dim=-1))
    return new, x_raw, torch.stack(mixes), torch.stack(sums)


def n_mixes(hc: int) -> int:
    """The mixes a site projects onto: C for pre, C for post, C * C for comb."""
    return (2 + hc) * hc


def hc_from_mixes(n_mix: int) -> int:
    """C from the (2 + C) * C mixes of a site."""
    c = math.isqrt(n_mix + 1) - 1
    if c < 1 or n_mixes(c) != n_mix:
        raise ValueError(f"MhcBoundaryFinish: {n_mix} mixes is not (2 + C) * C for any hc_mult C")
    return c


def mhc_boundary_finish(x_raw_BSE, mixes_PBSM, sums_PBS2, base_next, scale_next, norm_weight, iters: int,
                        hc_eps: float, rms_eps: float):
    """The split form's second half: the splits' partials summed, then what mhc_boundary does with
    the totals. -> (next sublayer input, next pre, next post, next comb)."""
    return finish_with_sinkhorn(sinkhorn, x_raw_BSE, mixes_PBSM, sums_PBS2, base_next, scale_next,
                                norm_weight, iters, hc_eps, rms_eps)


def finish_with_sinkhorn(sinkhorn_fn, x_raw_BSE, mixes_PBSM, sums_PBS2, base_next, scale_next, norm_weight,
                         iters: int, hc_eps: float, rms_eps: float):
    """mhc_boundary_finish with another Sinkhorn of the same maths, as boundary_with_sinkhorn."""
    return finish_from_sums(f32(mixes_PBSM).sum(0), f32(sums_PBS2).sum(0), x_raw_BSE, base_next, scale_next,
                            norm_weight, hc_from_mixes(mixes_PBSM.shape[-1]), iters, hc_eps, rms_eps,
                            sinkhorn_fn=sinkhorn_fn)


def partials_shape(streams, y, post, comb, pre, fn, block_e, split_target):
    b, s, _, e = streams
    _, n_split = split_plan(b * s, e, block_e, split_target)
    return [tuple(streams), (b, s, e), (n_split, b, s, fn[0]), (n_split, b, s, 2)]


def finish_shape(x_raw, mixes, sums, base, scale, norm_weight, iters, hc_eps, rms_eps):
    b, s, _ = x_raw
    c = hc_from_mixes(mixes[3])
    return [tuple(x_raw), (b, s, c), (b, s, c), (b, s, c, c)]
