"""One decoder block: Engram (at its layers), attention and MoE sublayers under single-pass mHC.

Order (ARCHITECTURE.md Part B §4 "Sublayer order"):
  1. Engram (layers in engram_layer_ids) on the residual streams
  2. (a_pre, a_post, a_comb) = mixes_attn(R)
  3. x = attn_norm(sum pi R);   R = a_post (x) Attn(x) + a_comb^T R
  4. (f_pre, f_post, f_comb) = mixes_ffn(R)
  5. x = ffn_norm(sum a_pre R); R = f_post (x) MoE(x) + f_comb^T R
  6. pi <- f_pre (handed to the next layer: the shift of V4.1)
"""

from __future__ import annotations

import torch
from torch import nn

from dsflash.model.attention import CSA2Attention
from dsflash.model.engram import Engram
from dsflash.model.mhc import hc_collapse, hc_mixes, hc_post
from dsflash.model.moe import MoE
from dsflash.model.norm_rope import RMSNorm


class Block(nn.Module):
    def __init__(self, cfg, layer: int, engram_rows: int | None):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        c, e = cfg.hc_mult, cfg.hidden_size
        n_mix = (2 + c) * c
        self.attn_norm = RMSNorm(e, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(e, cfg.rms_norm_eps)
        self.attn = CSA2Attention(cfg, layer)
        self.ffn = MoE(cfg)
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(n_mix, c * e)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(n_mix)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3)))
        self.engram = Engram(cfg, engram_rows) if engram_rows is not None else None

    def mixes(self, site: str, streams_BSCE: torch.Tensor):
        cfg = self.cfg
        return hc_mixes(streams_BSCE, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                        getattr(self, f"hc_{site}_scale"), cfg.hc_sinkhorn_iters, cfg.hc_eps,
                        cfg.rms_norm_eps)

    def attn_input(self, streams_BSCE, pi_BSC, engram_rows_BSR):
        """Steps 1 and the collapse of 3: the residual after Engram and the attention input."""
        if self.engram is not None:
            streams_BSCE = self.engram(streams_BSCE, engram_rows_BSR)
        return streams_BSCE, self.attn_norm(hc_collapse(streams_BSCE, pi_BSC))

    def forward(self, streams_BSCE, pi_BSC, engram_rows_BSR, attn_args: dict):
        streams, x = self.attn_input(streams_BSCE, pi_BSC, engram_rows_BSR)
        a_pre, a_post, a_comb = self.mixes("attn", streams)
        y, kv_rows, adds = self.attn(x, **attn_args)
        streams = hc_post(streams, y, a_post, a_comb)
        f_pre, f_post, f_comb = self.mixes("ffn", streams)
        y = self.ffn(self.ffn_norm(hc_collapse(streams, a_pre)))
        streams = hc_post(streams, y, f_post, f_comb)
        return streams, f_pre, kv_rows, adds
