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

from dsflash.model.dtypes import cast, f32

GATE_CLAMP = 1e-6  # TileKernels engram gate test: clamp of |d| before the square root


def engram_gate_update(streams_BSCE: torch.Tensor, kv_BSX: torch.Tensor, q_weight: torch.Tensor,
                       k_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Apply the gated value to every stream; all gate maths in fp32."""
    c, e = streams_BSCE.shape[-2:]
    keys = f32(kv_BSX[..., : c * e].unflatten(-1, (c, e)))
    value = f32(kv_BSX[..., c * e:])
    h = f32(streams_BSCE)
    w = (f32(q_weight) * f32(k_weight))
    dot = (h * w * keys).sum(-1)
    d = (dot * torch.rsqrt(h.pow(2).mean(-1) + eps) * torch.rsqrt(keys.pow(2).mean(-1) + eps)
         / math.sqrt(e))
    g = torch.sigmoid(torch.sign(d) * torch.sqrt(d.abs().clamp_min(GATE_CLAMP)))
    return cast(h + g.unsqueeze(-1) * value.unsqueeze(-2), streams_BSCE.dtype)


class Engram(nn.Module):
    """Parameters under the release names: embed.weight, wkv.weight, q_weight, k_weight."""

    def __init__(self, cfg, addressing, ops):
        super().__init__()
        e, c = cfg.hidden_size, cfg.hc_mult
        self.eps, self.heads, self.addr, self.ops = cfg.rms_norm_eps, cfg.engram_n_heads, addressing, ops
        self.embed = nn.Embedding(addressing.rows, cfg.engram_head_dim)
        self.wkv = nn.Linear(cfg.engram_heads_total * cfg.engram_head_dim, (c + 1) * e, bias=False)
        self.q_weight = nn.Parameter(torch.ones(c, e))
        self.k_weight = nn.Parameter(torch.ones(c, e))

    def forward(self, streams_BSCE: torch.Tensor, cids_BT: torch.Tensor) -> torch.Tensor:
        """cids_BT: compressed ids, the lookback then the S new rows (-1 before the start)."""
        a = self.addr
        rows = self.ops.engram_hash_gather(cids_BT, self.embed.weight, a.multipliers, a.primes,
                                           a.offsets, a.pad_id, self.heads)
        kv = self.wkv(cast(rows.flatten(-2), self.wkv.weight.dtype))
        return engram_gate_update(streams_BSCE, kv, self.q_weight, self.k_weight, self.eps)
