"""One layer: Engram (at its layers), attention and MoE sublayers under single-pass mHC.

Order (ARCHITECTURE.md Part B §4 "Sublayer order"):
  1. Engram (layers in engram_layer_ids) on the residual streams
  2. (a_pre, a_post, a_comb) = mixes_attn(R)
  3. x = attn_norm(sum pi R);   R = a_post (x) Attn(x) + a_comb^T R
  4. (f_pre, f_post, f_comb) = mixes_ffn(R)
  5. x = ffn_norm(sum a_pre R); R = f_post (x) MoE(x) + f_comb^T R
  6. pi <- f_pre (handed to the next layer: the shift of V4.1)
Because of the shift, "update of sublayer k, mixes of k+1, collapse + norm for k+1" is one
MhcBoundary op. The model's loop applies the FFN update of layer i together with layer i+1's
attention mixes (`attn_boundary`), except where Engram sits between them (`enter`).
"""

from __future__ import annotations

import torch
from torch import nn

from dsflash.model.attention import CSA2Attention
from dsflash.model.engram import Engram
from dsflash.model.mhc import hc_collapse, hc_mixes, n_mixes
from dsflash.model.moe import MoE
from dsflash.model.norm_rope import RMSNorm


class Block(nn.Module):
    def __init__(self, cfg, layer: int, ops, engram_addressing=None):
        super().__init__()
        self.cfg, self.layer, self.ops = cfg, layer, ops
        c, e = cfg.hc_mult, cfg.hidden_size
        n_mix = n_mixes(c)
        self.attn_norm = RMSNorm(e, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(e, cfg.rms_norm_eps)
        self.attn = CSA2Attention(cfg, layer, ops)
        self.ffn = MoE(cfg)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(n_mix, c * e)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(n_mix)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))
        self.engram = Engram(cfg, engram_addressing, ops) if engram_addressing is not None else None

    def site(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (getattr(self, f"hc_{name}_fn"), getattr(self, f"hc_{name}_base"),
                getattr(self, f"hc_{name}_scale"))

    def boundary(self, site: str, streams, y, post, comb, pre, norm: RMSNorm):
        cfg = self.cfg
        new, x, *coeffs = self.ops.mhc_boundary(streams, y, post, comb, pre, *self.site(site),
                                                norm.weight, cfg.hc_sinkhorn_iters, cfg.hc_eps,
                                                cfg.rms_norm_eps)
        return new, x, tuple(coeffs)

    def enter(self, streams_BSCE, pi_BSC, cids_BT):
        """Where the hand-off breaks (layer 0, Engram layers): Engram, then the attention site's
        coefficients and input op by op. Returns (streams, attention input, (pre, post, comb))."""
        cfg = self.cfg
        if self.engram is not None:
            streams_BSCE = self.engram(streams_BSCE, cids_BT)
        coeffs = hc_mixes(streams_BSCE, *self.site("attn"), cfg.hc_sinkhorn_iters, cfg.hc_eps,
                          cfg.rms_norm_eps, sinkhorn_fn=self.ops.sinkhorn)
        return streams_BSCE, self.attn_norm(hc_collapse(streams_BSCE, pi_BSC)), coeffs

    def attn_boundary(self, streams, y, post, comb, pre):
        """Previous layer's FFN update fused with this layer's attention mixes and input."""
        return self.boundary("attn", streams, y, post, comb, pre, self.attn_norm)

    def forward(self, streams_BSCE, x_BSE, attn_coeffs, attn_args: dict):
        """Attention, the attention->FFN boundary, the FFN. The FFN's update is left pending:
        returns (streams, ffn output, (f_pre, f_post, f_comb), window rows, source additions)."""
        a_pre, a_post, a_comb = attn_coeffs
        y, kv_rows, adds = self.attn(x_BSE, **attn_args)
        streams, x, f_coeffs = self.boundary("ffn", streams_BSCE, y, a_post, a_comb, a_pre, self.ffn_norm)
        return streams, self.ffn(x), f_coeffs, kv_rows, adds
