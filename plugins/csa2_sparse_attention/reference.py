"""Csa2SparseAttention reference: one softmax over the selected global entries and the window
keys, with a per-head sink that adds exp(sink_h - m) to the denominator only. K = V (MQA latent).

q [B,S,H,D]; kv [B,N,D] global entries; idx [B,S,K] selected entries (-1 = none);
win_kv [B,T,D] window keys; win_mask [B,S,T] which window keys each row sees; sink [H].
fp32 maths; the output has q's dtype. A row with no key at all gives 0 (all mass on the sink).
"""

from __future__ import annotations

import torch

from dsflash.plugins.dtypes import cast, f32


def csa2_sparse_attention(q_BSHD: torch.Tensor, kv_BND: torch.Tensor, idx_BSK: torch.Tensor,
                          win_kv_BTD: torch.Tensor, win_mask_BST: torch.Tensor, sink_H: torch.Tensor,
                          scale: float) -> torch.Tensor:
    q = f32(q_BSHD)
    b, s, k = idx_BSK.shape
    d = kv_BND.shape[-1]
    flat = idx_BSK.clamp_min(0).reshape(b, s * k, 1).expand(b, s * k, d)
    sel = f32(kv_BND).gather(1, flat).view(b, s, k, d)
    lg = torch.einsum("bshd,bskd->bshk", q, sel) * scale
    lg = lg.masked_fill((idx_BSK < 0).unsqueeze(2), float("-inf"))
    win = f32(win_kv_BTD)
    lw = torch.einsum("bshd,btd->bsht", q, win) * scale
    lw = lw.masked_fill(~win_mask_BST.unsqueeze(2), float("-inf"))
    logits = torch.cat((lg, lw), dim=-1)
    sink = f32(sink_H).view(1, 1, -1, 1)
    m = torch.maximum(logits.amax(-1, keepdim=True), sink).clamp_min(-1e30)
    p = torch.exp(logits - m)
    p = p / (p.sum(-1, keepdim=True) + torch.exp(sink - m))
    out = torch.einsum("bshk,bskd->bshd", p[..., :k], sel)
    out = out + torch.einsum("bsht,btd->bshd", p[..., k:], win)
    return cast(out, q_BSHD.dtype)


def shape(q_shape, kv_shape, idx_shape, win_shape, mask_shape, sink_shape, scale):
    return [tuple(q_shape)]
