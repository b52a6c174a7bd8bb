"""Engram memory injection (V4.1 form, ARCHITECTURE.md §4.7 and Part B §3 "Gate").

Per token: gather the 24 hashed rows (orders x heads) of the table, concatenate (order-major),
project with wkv to C stream keys + one shared value, then per stream k
  d = sum_c h[c] w[c] key[c] * rsqrt(mean h^2 + eps) * rsqrt(mean key^2 + eps) / sqrt(E)
  g = sigmoid(sign(d) sqrt(max(|d|, 1e-6)));  h <- h + g * value
with w = q_weight[k] * k_weight[k]. No short conv and no extra norm weights in V4.1.
"""

from __future__ import annotations

import math

import torch
from torch import nn

GATE_CLAMP = 1e-6  # TileKernels engram gate test: clamp of |d| before the square root


def engram_gate_update(streams_BSCE: torch.Tensor, kv_BSX: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Apply the gated value to every stream; all gate maths in fp32."""
    c, e = streams_BSCE.shape[-2:]
    keys = kv_BSX[..., : c * e].unflatten(-1, (c, e)).float()
    value = kv_BSX[..., c * e:].float()
    h = streams_BSCE.float()
    w = (q_weight.float() * k_weight.float())
    dot = (h * w * keys).sum(-1)
    d = (dot * torch.rsqrt(h.pow(2).mean(-1) + eps) * torch.rsqrt(keys.pow(2).mean(-1) + eps)
         / math.sqrt(e))
    g = torch.sigmoid(torch.sign(d) * torch.sqrt(d.abs().clamp_min(GATE_CLAMP)))
    return (h + g.unsqueeze(-1) * value.unsqueeze(-2)).to(streams_BSCE.dtype)


def gather_engram_rows(table: torch.Tensor, rows_BSR: torch.Tensor) -> torch.Tensor:
    """Rows of the table for every hashed id, flattened to [B, S, R * engram_dim].

    Row ids come from `hash_rows` (a modulus plus an offset), so they are in range by construction.
    """
    return table[rows_BSR].flatten(-2)


class Engram(nn.Module):
    """Parameters under the release names: embed.weight, wkv.weight, q_weight, k_weight."""

    def __init__(self, cfg, rows: int):
        super().__init__()
        e, c = cfg.hidden_size, cfg.hc_mult
        self.eps = cfg.rms_norm_eps
        self.embed = nn.Embedding(rows, cfg.engram_head_dim)
        self.wkv = nn.Linear(cfg.engram_heads_total * cfg.engram_head_dim, (c + 1) * e, bias=False)
        self.q_weight = nn.Parameter(torch.ones(c, e))
        self.k_weight = nn.Parameter(torch.ones(c, e))

    def forward(self, streams_BSCE: torch.Tensor, rows_BSR: torch.Tensor) -> torch.Tensor:
        gathered = gather_engram_rows(self.embed.weight, rows_BSR)
        kv = self.wkv(gathered.to(self.wkv.weight.dtype))
        return engram_gate_update(streams_BSCE, kv, self.q_weight, self.k_weight, self.eps)
