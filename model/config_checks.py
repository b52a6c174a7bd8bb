"""Validation of a ModelConfig against the spec's rules (ARCHITECTURE.md §2.2, §10 constraints).

Every failure is a ValueError that names the offending value and the limit it breaks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsflash.model.norm_rope import POSITION_LIMIT

if TYPE_CHECKING:
    from dsflash.model.config import ModelConfig


def whole_number(name: str, value):
    """`value` itself if it is an int or numpy integer, not a bool or a float: a 2.5 slots or
    tokens count is a caller's mistake to name, not to round."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}={value!r} must be an int, not {type(value).__name__}")
    return value


def positive_int(name: str, value):
    """`value` itself if it is a whole number (whole_number) > 0."""
    if whole_number(name, value) <= 0:
        raise ValueError(f"{name}={value} must be > 0")
    return value  # as given: int() would specialise a traced size (torch.SymInt) to one value


def _positive(cfg: ModelConfig, *names: str) -> None:
    for name in names:
        positive_int(name, getattr(cfg, name))


def validate_config(cfg: ModelConfig) -> None:
    _positive(cfg, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
              "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
              "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
              "candidate_topk_blocks", "candidate_block_size")
    n = cfg.num_hidden_layers
    if cfg.qk_rope_head_dim <= 0 or cfg.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be a positive even number")
    if cfg.head_dim <= cfg.qk_rope_head_dim:
        raise ValueError(f"head_dim={cfg.head_dim} must exceed qk_rope_head_dim={cfg.qk_rope_head_dim}")
    if cfg.index_head_dim < cfg.qk_rope_head_dim:
        raise ValueError(f"index_head_dim={cfg.index_head_dim} must be >= qk_rope_head_dim="
                         f"{cfg.qk_rope_head_dim} (index q/k carry the same rope slice)")
    if cfg.num_attention_heads % cfg.o_groups:
        raise ValueError(f"num_attention_heads={cfg.num_attention_heads} is not divisible by "
                         f"o_groups={cfg.o_groups}")
    if len(cfg.compress_ratios) != n:
        raise ValueError(f"compress_ratios has {len(cfg.compress_ratios)} entries; "
                         f"num_hidden_layers={n} requires exactly {n}")
    for i, m in enumerate(cfg.compress_ratios):
        if m < 0:
            raise ValueError(f"compress_ratios[{i}]={m} must be >= 0")
    _check_qat(cfg)
    _check_sources(cfg)
    _check_engram(cfg)
    _check_moe(cfg)
    if cfg.scoring_func != "sqrtsoftplus":
        raise ValueError(f"scoring_func={cfg.scoring_func!r} is not supported (only 'sqrtsoftplus')")
    if not 0 < cfg.max_position_embeddings <= POSITION_LIMIT:
        raise ValueError(f"max_position_embeddings={cfg.max_position_embeddings} must be in [1, "
                         f"{POSITION_LIMIT}] (rotary angles are formed from fp32 positions, exact "
                         "below 2^24)")
    if cfg.rope_scaling is not None and cfg.rope_scaling.get("type", "yarn") != "yarn":
        raise ValueError(f"rope_scaling type {cfg.rope_scaling.get('type')!r} is not supported "
                         "(only 'yarn')")


def _check_qat(cfg: ModelConfig) -> None:
    """kv_qat quantises whole blocks (model/quant.py): window KV in FP8 blocks of 32 channels,
    compressed KV in FP4 blocks of 16, index queries and keys in FP4 blocks of 32."""
    if not cfg.kv_qat:
        return
    for name, block in (("head_dim", 32), ("index_head_dim", 32)):
        value = getattr(cfg, name)
        if value % block:
            raise ValueError(f"{name}={value} must be a multiple of {block} with kv_qat (its "
                             f"quantisation block)")


def _check_layer_ids(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    ids = getattr(cfg, name)
    for i in ids:
        if not 0 <= i < cfg.num_hidden_layers:
            raise ValueError(f"{name} contains {i}, outside [0, {cfg.num_hidden_layers})")
    if list(ids) != sorted(set(ids)):
        raise ValueError(f"{name}={list(ids)} must be strictly increasing")
    return ids


def _check_sources(cfg: ModelConfig) -> None:
    kv = _check_layer_ids(cfg, "kv_source_layer_ids")
    idx = _check_layer_ids(cfg, "index_source_layer_ids")
    d = cfg.first_decoder_layer
    for s in kv:
        if cfg.compress_ratios[s] == 0:
            raise ValueError(f"KV source layer {s} has compress ratio 0; a source needs ratio >= 1")
        if s not in idx:
            raise ValueError(f"KV source layer {s} is not in index_source_layer_ids={list(idx)}; "
                             "every KV source is also an index source")
        if s > d:
            raise ValueError(f"KV source layer {s} is after the first decoder layer {d}; bounded "
                             "replay needs every KV source at or before it")
    for s in idx:
        if cfg.compress_ratios[s] == 0:
            raise ValueError(f"index source layer {s} has compress ratio 0")
    if not kv and any(cfg.compress_ratios):
        raise ValueError("compressed layers exist but kv_source_layer_ids is empty")
    if kv and cfg.candidate_source_layer_id != kv[-1]:
        raise ValueError(f"candidate_source_layer_id={cfg.candidate_source_layer_id} must be the last "
                         f"KV source ({kv[-1]})")
    for layer, m in enumerate(cfg.compress_ratios):
        if m == 0:
            continue
        src = cfg.kv_source_of(layer)
        if src is None:
            raise ValueError(f"layer {layer} ({cfg.layer_role(layer)}, ratio {m}) has no KV source "
                             f"with ratio {m} at or before it; sources: {list(kv)}")
        if cfg.topk_source_of(layer) is None:
            raise ValueError(f"layer {layer} (ratio {m}) has no index source at or before it")


def _check_engram(cfg: ModelConfig) -> None:
    ids = _check_layer_ids(cfg, "engram_layer_ids")
    if not ids:
        return
    d = cfg.first_decoder_layer
    for layer in ids:
        if layer > d:
            raise ValueError(f"Engram layer {layer} is after the first decoder layer {d}")
    _positive(cfg, "engram_n_heads", "engram_head_dim", "engram_vocab_size",
              "engram_compressed_vocab_size")
    if cfg.engram_max_ngram_size < 2:
        raise ValueError(f"engram_max_ngram_size={cfg.engram_max_ngram_size} must be >= 2")
    if cfg.engram_compressed_vocab_size > cfg.vocab_size:
        raise ValueError(f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size} exceeds "
                         f"vocab_size={cfg.vocab_size}")
    if not 0 <= cfg.engram_pad_token_id < cfg.vocab_size:
        raise ValueError(f"engram_pad_token_id={cfg.engram_pad_token_id} outside [0, {cfg.vocab_size})")
    rows = cfg.engram_num_embeddings
    if rows is not None and len(rows) != len(ids):
        raise ValueError(f"engram_num_embeddings has {len(rows)} entries for {len(ids)} Engram layers")


def _check_moe(cfg: ModelConfig) -> None:
    if cfg.n_routed_experts < 0:
        raise ValueError(f"n_routed_experts={cfg.n_routed_experts} must be >= 0")
    if cfg.n_routed_experts == 0:
        if cfg.intermediate_size <= 0:
            raise ValueError("a dense FFN (n_routed_experts=0) needs intermediate_size > 0, got "
                             f"{cfg.intermediate_size}")
        return
    if not 0 < cfg.num_experts_per_tok <= cfg.n_routed_experts:
        raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in "
                         f"[1, n_routed_experts={cfg.n_routed_experts}]")
    _positive(cfg, "moe_intermediate_size")
