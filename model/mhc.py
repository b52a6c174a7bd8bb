"""Single-pass (shifted) manifold-constrained hyper-connections (ARCHITECTURE.md §4.1, Part B §4).

The residual is `streams_BSCE` (C = hc_mult copies of the hidden state). Each sublayer site owns
`fn` [(2+C)*C, C*E], `base` [(2+C)*C] and `scale` [3] (fp32). From the residual entering a site:
  mixes = (flat . fn^T) * rsqrt(mean(flat^2) + rms_eps)
  pre  = sigmoid(mixes[:C] * scale0 + base[:C]) + hc_eps
  post = 2 sigmoid(mixes[C:2C] * scale1 + base[C:2C])
  comb = Sinkhorn(mixes[2C:] * scale2 + base[2C:] as C x C)
  update: R'_k = post_k * y + sum_j comb[j, k] R_j   (comb applied transposed)
Shift (V4.1): a site collapses with the pre handed in by the previous site, so the boundary
"post of k, mixes of k+1, collapse + norm for k+1" is one pass (`mhc_boundary`).
"""

from __future__ import annotations

import torch

from dsflash.model.norm_rope import rms_norm


def sinkhorn(logits_BSCC: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax + eps, then alternate column / row normalisation (iters steps in all)."""
    c = torch.softmax(logits_BSCC.float(), dim=-1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def split_mixes(mixes_BSM: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc: int,
                iters: int, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """24 raw mixes -> (pre [B,S,C], post [B,S,C], comb [B,S,C,C]) in fp32."""
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mixes_BSM[..., :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(mixes_BSM[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    logits = mixes_BSM[..., 2 * hc:] * scale[2] + base[2 * hc:]
    comb = sinkhorn(logits.unflatten(-1, (hc, hc)), iters, hc_eps)
    return pre, post, comb


def hc_mixes(streams_BSCE: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             iters: int, hc_eps: float, rms_eps: float):
    """Op-by-op form: normalise the flattened residual first, then project (transformers' order)."""
    flat = streams_BSCE.float().flatten(-2)
    normed = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + rms_eps)
    return split_mixes(normed @ fn.float().t(), base, scale, streams_BSCE.shape[-2], iters, hc_eps)


def hc_collapse(streams_BSCE: torch.Tensor, pre_BSC: torch.Tensor) -> torch.Tensor:
    return (pre_BSC.unsqueeze(-1) * streams_BSCE.float()).sum(-2).to(streams_BSCE.dtype)


def hc_post(streams_BSCE: torch.Tensor, y_BSE: torch.Tensor, post_BSC: torch.Tensor,
            comb_BSCC: torch.Tensor) -> torch.Tensor:
    """R'_k = post_k * y + sum_j comb[j,k] R_j, summed in fp32, rounded once."""
    mixed = torch.einsum("bsjk,bsje->bske", comb_BSCC, streams_BSCE.float())
    return (post_BSC.unsqueeze(-1) * y_BSE.float().unsqueeze(-2) + mixed).to(streams_BSCE.dtype)


def mhc_boundary(streams_BSCE, y_BSE, post_BSC, comb_BSCC, pre_BSC, fn_next, base_next, scale_next,
                 norm_weight, iters: int, hc_eps: float, rms_eps: float):
    """Fused-order boundary: one pass over the residual (the order the fused kernel uses).

    Returns (new streams, normalised input of the next sublayer collapsed with the carried pre,
    and the next site's (pre, post, comb)). The residual rms is folded after the projection.
    """
    new = hc_post(streams_BSCE, y_BSE, post_BSC, comb_BSCC)
    flat = new.float().flatten(-2)
    acc = flat @ fn_next.float().t()
    rstd = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + rms_eps)
    nxt = split_mixes(acc * rstd, base_next, scale_next, new.shape[-2], iters, hc_eps)
    x = rms_norm(hc_collapse(new, pre_BSC), norm_weight, rms_eps)
    return new, x, nxt
