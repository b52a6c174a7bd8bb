"""Csa2SparseAttention reference: one softmax over the selected global entries and the window
keys, with a per-head sink that adds exp(sink_h - m) to the denominator only. K = V (MQA latent).

q [B,S,H,D]; kv [B,N,D] global entries; idx [B,S,K] selected entries (-1 = none);
win_kv [B,T,D] window keys; win_mask [B,S,T] which window keys each row sees; sink [H].
fp32 maths; the output has q's dtype. A row with no key at all gives 0 (all mass on the sink).
"""

from __future__ import annotations

import torch

from dsflash.plugins.aot import cdiv_expr
from dsflash.plugins.csa2_sparse_attention.splits import split_plan
from dsflash.plugins.dtypes import cast, e2m1_values, e4m3_value, f32


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
    # a floor for the max when every logit and the sink are -inf (then p is 0, not NaN); the
    # dtype's own lowest value, so that an fp16 run of the reference does not overflow
    m = torch.maximum(logits.amax(-1, keepdim=True), sink).clamp_min(torch.finfo(logits.dtype).min)
    p = torch.exp(logits - m)
    p = p / (p.sum(-1, keepdim=True) + torch.exp(sink - m))
    out = torch.einsum("bshk,bskd->bshd", p[..., :k], sel)
    out = out + torch.einsum("bsht,btd->bshd", p[..., k:], win)
    return cast(out, q_BSHD.dtype)


def shape(q_shape, kv_shape, idx_shape, win_shape, mask_shape, sink_shape, scale):
    return [tuple(q_shape)]


def csa2_sparse_attention_split(q_BSHD: torch.Tensor, kv_BND: torch.Tensor, idx_BSK: torch.Tensor,
                                win_kv_BTD: torch.Tensor, win_mask_BST: torch.Tensor, sink_H: torch.Tensor,
                                scale: float, block_keys: int, split_target: int
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of the split form (splits.py says which keys each split holds): per split p,
    m_p = max(sink_h, its logits), l_p = sum exp(logit - m_p) and acc_p = sum exp(logit - m_p) kv
    over its visible keys. -> acc [B,S,P,H,D], ml [B,S,P,2,H] (the m plane, then the l plane),
    both fp32; a split without a visible key has m = sink, l = 0, acc = 0."""
    b, s, h, d = q_BSHD.shape
    k, t = idx_BSK.shape[2], win_kv_BTD.shape[1]
    per, n_split = split_plan(b * s, k, t, d, block_keys, split_target)
    q = f32(q_BSHD)
    flat = idx_BSK.clamp_min(0).reshape(b, s * k, 1).expand(b, s * k, d)
    values = torch.cat((f32(kv_BND).gather(1, flat).view(b, s, k, d),
                        f32(win_kv_BTD).unsqueeze(1).expand(b, s, t, d)), dim=2)  # [B,S,K+T,D]
    visible = torch.cat((idx_BSK >= 0, win_mask_BST), dim=-1)  # [B,S,K+T]
    logits = torch.einsum("bshd,bsld->bshl", q, values) * scale
    logits = logits.masked_fill(~visible.unsqueeze(2), float("-inf"))
    window_block = cdiv_expr(k, block_keys) + torch.arange(t) // block_keys
    block = torch.cat((torch.arange(k) // block_keys, window_block))
    member = (block // per).unsqueeze(0) == torch.arange(n_split).unsqueeze(1)  # [P, K+T]
    lg = logits.unsqueeze(2).masked_fill(~member.view(1, 1, n_split, 1, -1), float("-inf"))
    m = torch.maximum(lg.amax(-1), f32(sink_H).view(1, 1, 1, h))  # [B,S,P,H]
    p = torch.exp(lg - m.unsqueeze(-1))
    acc = torch.einsum("bsphl,bsld->bsphd", p, values)
    return acc, torch.stack((m, p.sum(-1)), dim=3)


def csa2_attention_combine(q_BSHD: torch.Tensor, acc_BSPHD: torch.Tensor, ml_BSP2H: torch.Tensor,
                           sink_H: torch.Tensor) -> torch.Tensor:
    """The second half: the splits' partial softmaxes weighted by exp(m_p - m) and normalised
    with the sink. q gives the output's shape and dtype only (its values are not read)."""
    m_p, l_p = f32(ml_BSP2H).unbind(3)
    sink = f32(sink_H).view(1, 1, -1)
    m = torch.maximum(m_p.amax(2), sink)  # [B,S,H]
    w = torch.exp(m_p - m.unsqueeze(2))
    out = (w.unsqueeze(-1) * f32(acc_BSPHD)).sum(2) / ((w * l_p).sum(2) + torch.exp(sink - m)).unsqueeze(-1)
    return cast(out, q_BSHD.dtype)


def csa2_attention_combine_normed(q_BSHD: torch.Tensor, parts_BSPHD: torch.Tensor, ml_BSP2H: torch.Tensor,
                                  sink_H: torch.Tensor) -> torch.Tensor:
    """csa2_attention_combine over partials each divided by its own sum l_p (0 where l_p = 0), as
    the JIT launch's split form writes them in the operands' dtype with NORMED_PARTS:
    weighted back by l_p, the same output (vLLM's paged attention v2 reduce weighs its
    partitions' normalised outputs by their rescaled exp sums the same way)."""
    l_p = f32(ml_BSP2H)[:, :, :, 1]
    return csa2_attention_combine(q_BSHD, f32(parts_BSPHD) * l_p.unsqueeze(-1), ml_BSP2H, sink_H)


def split_shape(q_shape, kv_shape, idx_shape, win_shape, mask_shape, sink_shape, scale, block_keys,
                split_target):
    b, s, h, d = q_shape
    _, n_split = split_plan(b * s, idx_shape[2], win_shape[1], d, block_keys, split_target)
    return [(b, s, n_split, h, d), (b, s, n_split, 2, h)]


def combine_shape(q_shape, acc_shape, ml_shape, sink_shape):
    return [tuple(q_shape)]


def unpack_entries_fp4(codes_BNC: torch.Tensor, scales_BNG: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """kv_qat's compressed entries as stored (model/quant.py:fp4_e4m3scale_pack: e2m1 codes two per
    byte [.., D/2], an e4m3 scale per 16 channels [.., D/16] as its bits) -> values [.., D] in
    dtype, exact (a grid value times an e4m3 scale has at most 6 significant bits)."""
    scale = e4m3_value(scales_BNG)
    return (e2m1_values(codes_BNC) * scale.unsqueeze(-1).expand(*scale.shape, 16).flatten(-2)).to(dtype)


def csa2_entries_fp4(q_BSHD: torch.Tensor, codes_BNC: torch.Tensor, scales_BNG: torch.Tensor,
                     idx_BSK: torch.Tensor) -> torch.Tensor:
    """The entries idx selects, decoded from kv_qat's FP4 storage: out[b, s*K + k] = entry
    idx[b, s, k] of batch row b ([B, S*K, D] in q's dtype; q's values are not read). An id outside
    [0, N) (-1: none) gives a zero row. Csa2SparseAttention then reads these S*K rows (the
    selection renumbered) instead of all N entries in bf16: a decode step decodes the K entries it
    attends to, not the cache (OpSet.csa2_entries_fp4); a prefill passes every id."""
    b, s, k = idx_BSK.shape
    n, c = codes_BNC.shape[1], codes_BNC.shape[2]
    ok = ((idx_BSK >= 0) & (idx_BSK < n)).reshape(b, s * k, 1)
    flat = torch.minimum(idx_BSK.clamp_min(0), torch.full_like(idx_BSK, n - 1)).reshape(b, s * k, 1)
    codes = codes_BNC.gather(1, flat.expand(b, s * k, c))
    scales = scales_BNG.gather(1, flat.expand(b, s * k, scales_BNG.shape[2]))
    return unpack_entries_fp4(codes, scales, q_BSHD.dtype).masked_fill(~ok, 0.0)


def entries_fp4_shape(q_shape, codes_shape, scales_shape, idx_shape):
    return [(idx_shape[0], idx_shape[1] * idx_shape[2], 2 * codes_shape[2])]

