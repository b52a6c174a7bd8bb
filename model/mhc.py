"""Single-pass (shifted) manifold-constrained hyper-connections (ARCHITECTURE.md §4.1, Part B §4).

The residual is `streams_BSCE` (C = hc_mult copies of the hidden state). Each sublayer site owns
`fn` [(2+C)*C, C*E], `base` [(2+C)*C] and `scale` [3] (fp32). The fused boundary and its pieces
(Sinkhorn, coefficient split, post update, collapse) are the MhcBoundary op's reference; this
module adds the op-by-op coefficient form used where the hand-off breaks (Engram layers, the
first layer) and as the check of the fused order.
"""

from __future__ import annotations

import torch

from dsflash.model.dtypes import f32
from dsflash.plugins.mhc_boundary.reference import (
    hc_collapse,
    hc_post,
    mhc_boundary,
    n_mixes,
    sinkhorn,
    split_mixes,
)

__all__ = ["hc_collapse", "hc_mixes", "hc_post", "mhc_boundary", "n_mixes", "sinkhorn", "split_mixes"]


def hc_mixes(streams_BSCE: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
             iters: int, hc_eps: float, rms_eps: float, *, sinkhorn_fn=sinkhorn):
    """Op-by-op form: normalise the flattened residual first, then project (transformers' order).
    `sinkhorn_fn`: as in split_mixes (the model passes OpSet.sinkhorn)."""
    flat = f32(streams_BSCE).flatten(-2)
    normed = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + rms_eps)
    return split_mixes(normed @ f32(fn).t(), base, scale, streams_BSCE.shape[-2], iters, hc_eps,
                       sinkhorn_fn=sinkhorn_fn)
