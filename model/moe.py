"""Mixture of experts (ARCHITECTURE.md §4.6, Part B §5 "MoE").

Router (fp32): s = sqrt(softplus(x W_g^T / gate_temp)); pick the top-k of s + bias (selection
only); weights = s_sel / (sum s_sel + 1e-20) * routed_scaling_factor. Experts are SwiGLU with
clamps, silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit); the routing weight multiplies the
hidden activation before w2 (reference model.py order). The shared expert is added unweighted.
`n_routed_experts = 0` gives a dense SwiGLU FFN (ffn.w1/w2/w3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def clamped_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, limit: float) -> torch.Tensor:
    gate = F.linear(x, w1).float()
    up = F.linear(x, w3).float()
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        h = clamped_swiglu(x, self.w1.weight, self.w3.weight, self.limit)
        if weight is not None:
            h = h * weight.unsqueeze(-1)
        return self.w2(h.to(x.dtype))


class Router(nn.Module):
    """Parameters `gate.weight`, `gate.bias` (selection bias) and `gate.bias_vl` (image tokens)."""

    def __init__(self, cfg):
        super().__init__()
        n = cfg.n_routed_experts
        self.top_k, self.scale, self.temp = cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.gate_temp
        self.norm_topk = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(n, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(n))
        self.bias_vl = nn.Parameter(torch.zeros(n))

    def forward(self, x_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x_TE.float(), self.weight.float()) / self.temp
        scores = torch.sqrt(F.softplus(logits))
        idx = torch.topk(scores + self.bias.float(), self.top_k, dim=-1).indices
        w = scores.gather(-1, idx)
        if self.norm_topk:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scale


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        e, limit = cfg.hidden_size, cfg.swiglu_limit
        self.dense = cfg.n_routed_experts == 0
        if self.dense:
            inter = cfg.intermediate_size
            self.w1 = nn.Linear(e, inter, bias=False)
            self.w2 = nn.Linear(inter, e, bias=False)
            self.w3 = nn.Linear(e, inter, bias=False)
            self.limit = limit
            return
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            Expert(e, cfg.moe_intermediate_size, limit) for _ in range(cfg.n_routed_experts))
        self.shared_experts = (Expert(e, cfg.moe_intermediate_size * cfg.n_shared_experts, limit)
                               if cfg.n_shared_experts else None)

    def forward(self, x_BSE: torch.Tensor) -> torch.Tensor:
        if self.dense:
            return self.w2(clamped_swiglu(x_BSE, self.w1.weight, self.w3.weight, self.limit).to(x_BSE.dtype))
        x = x_BSE.flatten(0, -2)
        idx, w = self.gate(x)
        out = torch.zeros_like(x, dtype=torch.float32)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.nonzero(idx == e, as_tuple=True)
            if tok.numel() == 0:
                continue
            out.index_add_(0, tok, expert(x[tok], w[tok, slot]).float())
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        return out.to(x_BSE.dtype).view_as(x_BSE)
