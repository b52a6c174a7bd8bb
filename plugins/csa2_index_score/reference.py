"""Csa2IndexScore reference: lightning-indexer scores over compressed entries.

I[b,s,n] = sum_i w[b,s,i] * relu(q[b,s,i,:] . k[b,n,:]), -inf where entry n is not visible to
row s. fp32 maths. Top-k and the candidate block max stay standard ops around it.
"""

from __future__ import annotations

import torch

from dsflash.plugins.dtypes import e2m1_values, exact_pow2, f32
from dsflash.plugins.stable_topk.reference import block_maxima


def csa2_index_score(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, k_BNJ: torch.Tensor,
                     visible_BSN: torch.Tensor) -> torch.Tensor:
    dots = torch.einsum("bsij,bnj->bsin", f32(q_BSIJ), f32(k_BNJ)).relu()
    scores = torch.einsum("bsin,bsi->bsn", dots, f32(w_BSI))
    return scores.masked_fill(~visible_BSN, float("-inf"))


def unpack_keys_fp4(codes_BNH: torch.Tensor, exps_BNG: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP4 index keys (model/quant.py:fp4_pow2_pack: e2m1 codes two per byte, low nibble first,
    bit 3 the sign; one power-of-two exponent per 32 channels) -> keys [B, N, J] in dtype, exact
    (a grid value times a power of two, formed in fp32)."""
    val = e2m1_values(codes_BNH)
    scale = exact_pow2(exps_BNG.long(), -128, 127)
    return (val * scale.unsqueeze(-1).expand(*scale.shape, 32).flatten(-2)).to(dtype)


def csa2_index_score_fp4(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, codes_BNH: torch.Tensor,
                         exps_BNG: torch.Tensor, visible_BSN: torch.Tensor) -> torch.Tensor:
    """The same scores over FP4 keys as stored in the release (68 B per entry instead of 256)."""
    return csa2_index_score(q_BSIJ, w_BSI, unpack_keys_fp4(codes_BNH, exps_BNG, q_BSIJ.dtype), visible_BSN)


def csa2_index_score_pooled(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, k_BNJ: torch.Tensor,
                            entries_BSP: torch.Tensor) -> torch.Tensor:
    """Scores of listed entries: out[b, s, p] = I[b, s, entries[b, s, p]], the scores above with
    every entry visible; -inf where the id is outside [0, N) (-1 pads a list). A Reindex layer
    lists its candidate pool (model/csa2_ops.py:pool_entry_list) and scores only those entries
    (kernel.py:csa2_index_score_pooled reads only their keys). Defined through the full scores,
    so it gives the mask form's bits at every listed entry."""
    b, s, _ = entries_BSP.shape
    n = k_BNJ.shape[1]
    listed = (entries_BSP >= 0) & (entries_BSP < n)
    if n == 0:
        return torch.full(entries_BSP.shape, float("-inf"), dtype=torch.float32, device=k_BNJ.device)
    everything = torch.ones(b, s, n, dtype=torch.bool, device=k_BNJ.device)
    scores = csa2_index_score(q_BSIJ, w_BSI, k_BNJ, everything)
    picked = scores.gather(2, entries_BSP.long().clamp(0, n - 1))
    return picked.masked_fill(~listed, float("-inf"))


def csa2_index_score_fp4_pooled(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, codes_BNH: torch.Tensor,
                                exps_BNG: torch.Tensor, entries_BSP: torch.Tensor) -> torch.Tensor:
    """Scores of listed entries over FP4 keys as stored in the release: csa2_index_score_pooled
    with the keys unpacked (unpack_keys_fp4)."""
    return csa2_index_score_pooled(q_BSIJ, w_BSI, unpack_keys_fp4(codes_BNH, exps_BNG, q_BSIJ.dtype), entries_BSP)


def csa2_index_score_pooled_maxima(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, k_BNJ: torch.Tensor,
                                   entries_BSP: torch.Tensor,
                                   block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """csa2_index_score_pooled's scores [B, S, P] and their block maxima [B, S, cdiv(P, block)]
    (stable_topk/reference.py:block_maxima), which the block-max top-k over the list would
    otherwise compute in a launch of its own (the kernel writes them as it stores the scores)."""
    scores = csa2_index_score_pooled(q_BSIJ, w_BSI, k_BNJ, entries_BSP)
    return scores, block_maxima(scores, block)


def csa2_index_score_fp4_pooled_maxima(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, codes_BNH: torch.Tensor,
                                       exps_BNG: torch.Tensor, entries_BSP: torch.Tensor,
                                       block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """csa2_index_score_pooled_maxima over FP4 keys (csa2_index_score_fp4_pooled)."""
    scores = csa2_index_score_fp4_pooled(q_BSIJ, w_BSI, codes_BNH, exps_BNG, entries_BSP)
    return scores, block_maxima(scores, block)


def shape(q_shape, w_shape, k_shape, visible_shape):
    return [(q_shape[0], q_shape[1], k_shape[1])]


def shape_fp4(q_shape, w_shape, codes_shape, exps_shape, visible_shape):
    return [(q_shape[0], q_shape[1], codes_shape[1])]
