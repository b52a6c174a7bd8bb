"""Parameter and cache-byte accounting (ARCHITECTURE.md §6, §10 items 7-8).

Parameters are counted from a model built on the meta device. "Activated" counts what one row
touches: one embedding row, the gathered Engram rows, top-k of the routed experts; a prefill row
runs the encoder half plus layer D's compressor publication, a decode row every layer and the head.

Cache bytes come from the cache layout (model/cache.py) in two formats:
  released  global KV entry FP4 e2m1 + one e4m3 scale per 16 channels (D/2 + D/16 B),
            index key FP4 + one ue8m0 scale per 32 (J/2 + J/32 B), SWA ring FP8 + ue8m0/32
  bf16      every cache tensor in bf16 (2 B per value)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from dsflash.model.config import ModelConfig

FORMATS = ("released", "bf16")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_PUBLISH = ("attn_norm.", "attn.compressor.", "attn.indexer.wk.", "attn.indexer.k_norm.", "engram.")


@dataclass(frozen=True)
class ParamCounts:
    backbone: int
    engram_tables: int
    activated_prefill_row: int
    activated_decode_row: int

    @property
    def total(self) -> int:
        return self.backbone + self.engram_tables


def count_parameters(model: nn.Module, cfg: ModelConfig) -> ParamCounts:
    backbone = tables = prefill = decode = 0
    d = cfg.first_decoder_layer
    expert_share = (cfg.num_experts_per_tok / cfg.n_routed_experts) if cfg.n_routed_experts else 1.0
    for name, p in model.named_parameters():
        n = p.numel()
        is_table = ".engram.embed." in name
        tables += n if is_table else 0
        backbone += 0 if is_table else n
        if name == "embed.weight":
            active = p.shape[1]
        elif is_table:
            active = cfg.engram_heads_total * p.shape[1]
        elif ".ffn.experts." in name:
            active = n * expert_share
        else:
            active = n
        decode += active
        match = _LAYER.match(name)
        if match is None:
            prefill += active if name == "embed.weight" else 0
            continue
        layer, rest = int(match.group(1)), name[match.end():]
        if layer < d or (layer == d and rest.startswith(_PUBLISH)):
            prefill += active
    return ParamCounts(backbone, tables, round(prefill), round(decode))


def entry_bytes(cfg: ModelConfig, fmt: str) -> tuple[int, int]:
    """(global KV entry, index key) bytes in a cache format."""
    d, j = cfg.head_dim, cfg.index_head_dim
    if fmt == "released":
        return d // 2 + d // 16, j // 2 + j // 32
    if fmt == "bf16":
        return 2 * d, 2 * j
    raise ValueError(f"unknown cache format {fmt!r}; known: {FORMATS}")


def global_kv_bytes_per_token(cfg: ModelConfig, fmt: str = "released") -> float:
    """Entries per token = sum over KV sources of 1/m, times (KV entry + index key) bytes."""
    kv, idx = entry_bytes(cfg, fmt)
    return sum((kv + idx) / cfg.layer_ratio(s) for s in cfg.kv_source_layer_ids)


def per_sequence_bytes(cfg: ModelConfig, fmt: str = "released") -> dict[str, int]:
    """Constants per sequence: SWA rings, compressor partial state (fp32), Engram lookback."""
    d, w, layers = cfg.head_dim, cfg.sliding_window, cfg.num_hidden_layers
    slot = d + d // 32 if fmt == "released" else 2 * d
    if fmt not in FORMATS:
        raise ValueError(f"unknown cache format {fmt!r}; known: {FORMATS}")
    comp = sum(2 * (cfg.layer_ratio(s) - 1) * d * 4 for s in cfg.kv_source_layer_ids)
    return {"swa_rings": layers * w * slot, "compressor_state": comp,
            "engram_lookback": (cfg.engram_max_ngram_size - 1) * 8, "counters": 3 * 8}


def sequence_bytes(cfg: ModelConfig, context_len: int, fmt: str = "released") -> int:
    """Bytes one sequence of context_len tokens holds (global entries stored per complete group)."""
    kv, idx = entry_bytes(cfg, fmt)
    entries = sum(context_len // cfg.layer_ratio(s) for s in cfg.kv_source_layer_ids)
    return entries * (kv + idx) + sum(per_sequence_bytes(cfg, fmt).values())


def max_sequences(cfg: ModelConfig, budget_bytes: int, context_len: int, fmt: str = "released") -> int:
    if budget_bytes < 0 or context_len <= 0:
        raise ValueError(f"budget_bytes={budget_bytes} and context_len={context_len} must be positive")
    return budget_bytes // sequence_bytes(cfg, context_len, fmt)


def decode_step_bytes(model: nn.Module, cfg: ModelConfig, batch: int, context_len: int,
                      elem_bytes: int = 2) -> dict[str, int]:
    """Bytes one decode step of `batch` rows at `context_len` cached tokens must read at least,
    every tensor in a dtype of `elem_bytes` (the roofline of scripts/bench_decode.py).

    weights: every parameter once, except the embedding and Engram tables (only the rows the
    batch gathers) and the routed experts (the expected number of distinct experts `batch` rows
    pick per layer, E(1 - (1 - k/E)^batch), if the router picked uniformly). cache, per row and
    layer: the window ring (W rows); for compressed layers the selected entries (min(topk,
    visible)); for Full and Reindex layers the index keys they score: all visible entries of the
    source, or the candidate pool's blocks where a Reindex layer uses it."""
    weights = 0
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    distinct = e * (1 - (1 - k / e) ** batch) if e else 0.0
    for name, p in model.named_parameters():
        if name == "embed.weight":
            weights += min(batch, p.shape[0]) * p.shape[1]
        elif ".engram.embed." in name:
            weights += min(batch * cfg.engram_heads_total, p.shape[0]) * p.shape[1]
        elif ".ffn.experts." in name:
            weights += p.numel() * distinct / e
        else:
            weights += p.numel()
    d, j, w = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
    per_row = 0
    for layer, role in enumerate(cfg.layer_roles):
        per_row += min(w, context_len) * d
        if role == "window":
            continue
        visible = context_len // cfg.layer_ratio(layer)
        per_row += min(cfg.index_topk, visible) * d
        if role == "full":
            per_row += visible * j
        elif role == "reindex":
            pool = cfg.candidate_topk_blocks * cfg.candidate_block_size
            per_row += (min(pool, visible) if cfg.uses_candidate_pool(layer) else visible) * j
    return {"weights": round(weights * elem_bytes), "cache": batch * per_row * elem_bytes}
