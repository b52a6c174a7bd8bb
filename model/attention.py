"""CSA2 attention layer, all four modes (ARCHITECTURE.md §4.2-4.5, Part B §5).

Every layer: q LoRA path, its own window KV (K = V, MQA), sparse attention with a per-head sink,
inverse RoPE on the output, grouped low-rank output projection. Full layers also run the
compressor (publishing global KV + index keys) and the indexer; Reindex layers run their own
index queries over the source's keys (inside the candidate pool when after the candidate
source); Reuse layers use the latest published selection.

A call processes S new rows. The caller supplies the window buffer (earlier rows of this layer
with their positions) and, for Full layers, the source's cached entries and compressor state;
the layer returns its output, its new window rows and (Full) what the step adds to the source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dsflash.model import csa2_ops as ops
from dsflash.model.dtypes import cast, f32
from dsflash.model.norm_rope import RMSNorm, Rotary, apply_rope, rms_norm


@dataclass
class SourceEntries:
    """A KV source's entries visible this step: cached ones, then one candidate per new row. With
    kv_qat both are FP4: the entries' codes [B, N, D/2] uint8 in kv_BND with their e4m3 scale bits
    in kv_scale_BNG, the index keys' codes [B, N, J/2] in index_k_BNJ with exponents in index_e_BNG."""

    kv_BND: torch.Tensor
    index_k_BNJ: torch.Tensor
    group_BN: torch.Tensor
    index_e_BNG: torch.Tensor | None = None
    kv_scale_BNG: torch.Tensor | None = None


@dataclass
class StepShared:
    """What layers publish to later layers within one step (same rows)."""

    entries: dict[int, SourceEntries] = field(default_factory=dict)
    topk: dict[int, torch.Tensor] = field(default_factory=dict)
    candidates_BSN: torch.Tensor | None = None
    # The same pool as a list of entry ids [B, S, P] (when the OpSet lists pools: OpSet.pool_form).
    candidate_list_BSP: torch.Tensor | None = None
    # When a dict, each layer stores the selection it attended with (tests and debugging).
    used_topk: dict[int, torch.Tensor] | None = None
    # rotary tables of the step's rows, per frequency set: (positions, cos, sin)
    rope: dict[tuple, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def rope_tables(self, rotary: Rotary, pos_BS: torch.Tensor,
                    ratio: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of `rotary` at the rows' positions pos_BS, or with `ratio` at the positions
        of the entries they publish (the first position of each completed group of `ratio`
        rows; 0 where none completes). Formed once per step and frequency set: every layer of a
        kind rotates the same rows, and each table is 24 small kernels (launches, in a CUDA graph)."""
        key = (rotary.key, ratio)
        hit = self.rope.get(key)
        if hit is None or hit[0] is not pos_BS:
            at = pos_BS if not ratio else torch.clamp_min(ops.completed_group(pos_BS, ratio), 0) * ratio
            hit = (pos_BS, *rotary.cos_sin(at))
            self.rope[key] = hit
        return hit[1], hit[2]


@dataclass
class SourceState:
    """A Full layer's cache view: entries, their group ids (-1 empty) and compressor state."""

    kv_BND: torch.Tensor
    index_k_BNJ: torch.Tensor
    group_BN: torch.Tensor
    comp_kv: torch.Tensor
    comp_score: torch.Tensor
    index_e_BNG: torch.Tensor | None = None  # kv_qat: FP4 index keys (SourceEntries)
    kv_scale_BNG: torch.Tensor | None = None  # kv_qat: FP4 entries (SourceEntries)


class Compressor(nn.Module):
    def __init__(self, cfg, ratio: int):
        super().__init__()
        e, d = cfg.hidden_size, cfg.head_dim
        self.ratio, self.eps = ratio, cfg.rms_norm_eps
        self.wkv = nn.Linear(e, d, bias=False)
        self.wgate = nn.Linear(e, d, bias=False) if ratio > 1 else None
        self.norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x_BSE: torch.Tensor, state: SourceState) -> tuple[torch.Tensor, ...]:
        # Pooling is fp32 (the release promotes the bf16 weights), then one rounding + RMSNorm.
        xf = f32(x_BSE)
        u = xf @ f32(self.wkv.weight).t()
        z = xf @ f32(self.wgate.weight).t() if self.wgate is not None else None
        pooled, su, sz = ops.pool_groups(u, z, state.comp_kv, state.comp_score, self.ratio)
        return self.norm(cast(pooled, x_BSE.dtype)), su, sz


class Indexer(nn.Module):
    """Lightning indexer: index queries from the q latent, head weights from x; keys at sources."""

    def __init__(self, cfg, owns_keys: bool, ops):
        super().__init__()
        self.ops = ops  # the kv_qat round-trips (OpSet.qat)
        self.n_heads, self.dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(cfg.head_dim, self.dim, bias=False)
            self.k_norm = RMSNorm(self.dim, cfg.rms_norm_eps)

    def queries(self, qr_BSQ, x_BSE, cos, sin, qat: bool):
        q = self.wq_b(qr_BSQ).unflatten(-1, (self.n_heads, self.dim))
        q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        if qat:
            q = self.ops.qat("fp4_pow2_qat", q)
        w = f32(self.weights_proj(x_BSE)) * (self.dim ** -0.5) * (self.n_heads ** -0.5)
        return q, w

    def keys(self, latent_BSD, cos, sin, qat: bool) -> dict[str, torch.Tensor]:
        """{"index_k": keys} or, with kv_qat, their FP4 storage {"index_k": codes, "index_e":
        exponents}: exactly fp4_pow2_qat's values (the release keeps its index keys so)."""
        k = apply_rope(self.k_norm(self.wk(latent_BSD)), cos, sin)
        if not qat:
            return {"index_k": k}
        codes, exps = self.ops.qat("fp4_pow2_pack", k)
        return {"index_k": codes, "index_e": exps}


class CSA2Attention(nn.Module):
    def __init__(self, cfg, layer: int, ops):
        super().__init__()
        self.cfg, self.layer, self.ops = cfg, layer, ops
        self.role, self.ratio = cfg.layer_role(layer), cfg.layer_ratio(layer)
        h, d, e = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.wq_a = nn.Linear(e, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.wkv = nn.Linear(e, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.attn_sink = nn.Parameter(torch.zeros(h))
        self.wo_a = nn.Linear(cfg.heads_per_group * d, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, e, bias=False)
        if self.role == "full":
            self.compressor = Compressor(cfg, self.ratio)
        if self.role in ("full", "reindex"):
            self.indexer = Indexer(cfg, owns_keys=self.role == "full", ops=ops)
        yarn = cfg.rope_scaling if cfg.uses_yarn(layer) else None
        self.rotary = Rotary(cfg.qk_rope_head_dim, cfg.rope_theta_of(layer), yarn)

    def forward(self, x_BSE, pos_BS, win_kv_BTD, win_pos_BT, win_start_B, shared: StepShared,
                source: SourceState | None = None):
        cfg, qat = self.cfg, self.cfg.kv_qat
        cos, sin = shared.rope_tables(self.rotary, pos_BS)
        qr = self.q_norm(self.wq_a(x_BSE))
        q = self.wq_b(qr).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim))
        if cfg.q_head_norm:
            q = rms_norm(q, None, cfg.rms_norm_eps)
        q = apply_rope(q, cos.unsqueeze(-2), sin.unsqueeze(-2))
        kv = apply_rope(self.kv_norm(self.wkv(x_BSE)), cos, sin)
        if qat:
            kv = self.ops.qat("fp8_e4m3_qat", kv)
        adds = None
        if self.role == "full":
            adds = self._publish(x_BSE, pos_BS, source, shared)
        idx = self._select(qr, x_BSE, pos_BS, cos, sin, shared)
        if shared.used_topk is not None:
            shared.used_topk[self.layer] = idx
        win_kv = torch.cat((win_kv_BTD, kv), dim=1)
        win_pos = torch.cat((win_pos_BT, pos_BS), dim=1)
        mask = ops.window_mask(win_pos, pos_BS, cfg.sliding_window, win_start_B)
        scale = cfg.head_dim ** -0.5
        src = None if idx is None else shared.entries[cfg.kv_source_of(self.layer)]
        if src is None:  # a Window layer: no global entry
            o = self.ops.csa2_sparse_attention(q, kv.new_zeros(kv.shape[0], 1, cfg.head_dim),
                                               torch.full_like(pos_BS, -1).unsqueeze(-1), win_kv, mask,
                                               self.attn_sink, scale)
        elif src.kv_scale_BNG is not None:  # kv_qat: the entries in FP4, as the cache holds them
            o = self.ops.csa2_sparse_attention_fp4(q, src.kv_BND, src.kv_scale_BNG, idx, win_kv, mask,
                                                   self.attn_sink, scale)
        else:
            o = self.ops.csa2_sparse_attention(q, src.kv_BND, idx, win_kv, mask, self.attn_sink, scale)
        o = apply_rope(o, cos.unsqueeze(-2), sin.unsqueeze(-2), inverse=True)
        return self._project_out(o), kv, adds

    def _project_out(self, o_BSHD: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        grouped = o_BSHD.flatten(-2).unflatten(-1, (cfg.o_groups, -1))
        wa = self.wo_a.weight.view(cfg.o_groups, cfg.o_lora_rank, -1)
        # [B,S,G,1,I] @ [G,I,R]: a MatMul, since ONNX's Einsum has no bfloat16 type (moe.py)
        z = torch.matmul(grouped.unsqueeze(-2), wa.transpose(1, 2)).squeeze(-2)
        return self.wo_b(z.flatten(-2))

    def _publish(self, x_BSE, pos_BS, source: SourceState, shared: StepShared) -> dict:
        """Compressor: new entries for rows that complete a group, merged with the cache view."""
        m = self.ratio
        latent, su, sz = self.compressor(x_BSE, source)
        group = ops.completed_group(pos_BS, m)
        cos, sin = shared.rope_tables(self.rotary, pos_BS, ratio=m)
        keys = self.indexer.keys(latent, cos, sin, self.cfg.kv_qat)
        entry = {"kv": apply_rope(latent, cos, sin)}
        if self.cfg.kv_qat:  # the release's FP4 entries, stored packed (exactly fp4_e4m3scale_qat's values)
            entry = dict(zip(("kv", "kv_scale"), self.ops.qat("fp4_e4m3scale_pack", entry["kv"])))

        def grown(cached, new):
            return None if new is None else torch.cat((cached, new), dim=1)

        shared.entries[self.layer] = SourceEntries(
            kv_BND=grown(source.kv_BND, entry["kv"]),
            index_k_BNJ=grown(source.index_k_BNJ, keys["index_k"]),
            group_BN=grown(source.group_BN, group),
            index_e_BNG=grown(source.index_e_BNG, keys.get("index_e")),
            kv_scale_BNG=grown(source.kv_scale_BNG, entry.get("kv_scale")))
        return {**entry, **keys, "group": group, "comp_kv": su, "comp_score": sz}

    def _select(self, qr, x_BSE, pos_BS, cos, sin, shared: StepShared) -> torch.Tensor | None:
        cfg = self.cfg
        if self.role == "window":
            return None
        if self.role == "reuse":
            return shared.topk[cfg.topk_source_of(self.layer)]
        src = shared.entries[cfg.kv_source_of(self.layer)]
        q, w = self.indexer.queries(qr, x_BSE, cos, sin, cfg.kv_qat)
        if cfg.uses_candidate_pool(self.layer) and shared.candidate_list_BSP is not None:
            # the listed pool: only its entries are scored and ranked (same selection as the mask)
            pool = shared.candidate_list_BSP
            idx = self.ops.select_in_listed_pool(q, w, src.index_k_BNJ, pool, src.index_e_BNG, cfg.index_topk,
                                                 src.group_BN.shape[1])
            shared.topk[self.layer] = idx
            return idx
        visible = ops.visible_entries(src.group_BN, pos_BS, self.ratio)
        if cfg.uses_candidate_pool(self.layer):
            visible = visible & shared.candidates_BSN
        scores = self.ops.csa2_index_score(q, w, src.index_k_BNJ, visible, src.index_e_BNG)
        if self.layer == cfg.candidate_source_layer_id:
            self._publish_pool(scores, src.group_BN, pos_BS, visible, shared)
        idx = ops.select_topk(scores, cfg.index_topk, topk=self.ops.stable_topk)
        shared.topk[self.layer] = idx
        return idx

    def _publish_pool(self, scores_BSN, group_BN, pos_BS, visible_BSN, shared: StepShared) -> None:
        """The candidate source's pool for later Reindex layers of its ratio: as a mask, or listed
        (its visible entries; those layers see the same group ids, positions // ratio)."""
        cfg = self.cfg
        pool = ops.candidate_pool(scores_BSN, group_BN, pos_BS, self.ratio, cfg.candidate_block_size,
                                  cfg.candidate_topk_blocks, topk=self.ops.stable_topk)
        if self.ops.lists_pool:
            size = min(group_BN.shape[1], cfg.candidate_topk_blocks * cfg.candidate_block_size)
            shared.candidate_list_BSP = self.ops.pool_entry_list(pool & visible_BSN, size)
        else:
            shared.candidates_BSN = pool
