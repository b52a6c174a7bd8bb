"""Csa2IndexScore reference: lightning-indexer scores over compressed entries.

I[b,s,n] = sum_i w[b,s,i] * relu(q[b,s,i,:] . k[b,n,:]), -inf where entry n is not visible to
row s. fp32 maths. Top-k and the candidate block max stay standard ops around it.
"""

from __future__ import annotations

import torch

from dsflash.plugins.dtypes import f32


def csa2_index_score(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, k_BNJ: torch.Tensor,
                     visible_BSN: torch.Tensor) -> torch.Tensor:
    dots = torch.einsum("bsij,bnj->bsin", f32(q_BSIJ), f32(k_BNJ)).relu()
    scores = torch.einsum("bsin,bsi->bsn", dots, f32(w_BSI))
    return scores.masked_fill(~visible_BSN, float("-inf"))


def shape(q_shape, w_shape, k_shape, visible_shape):
    return [(q_shape[0], q_shape[1], k_shape[1])]
