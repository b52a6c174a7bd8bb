"""Model configuration: one frozen dataclass with the released `config.json` field names.

Shape legend used in names across dsflash (`ids_BS`, `q_BSHD`, `kv_BND`, ...):
  B batch slots   S new rows of a step   T positions in a window buffer   N compressed entries
  H attention heads   D head_dim   E hidden_size   C hc_mult streams (mHC)   K selected entries
  I index heads   J index_head_dim   V vocabulary   W sliding window   G output groups
Derived values (layer roles, sources, the first decoder layer) are properties.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("window", "full", "reindex", "reuse")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] = (0, 0) + (2,) * 18 + (1,) * 20
    kv_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layer_ids: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer_id: int = 20
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = (1, 14)
    engram_num_embeddings: tuple[int, ...] = (384006168, 384016682)
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16_000_000
    engram_compressed_vocab_size: int = 99092
    engram_pad_token_id: int = 2
    n_routed_experts: int = 384
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2304
    intermediate_size: int = 0  # dense SwiGLU width, used only when n_routed_experts == 0
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    gate_temp: float = 1.0  # ASSUMED (ARCHITECTURE.md §4.6): router logits are divided by it
    rms_norm_eps: float = 1e-20
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict[str, Any] | None = field(
        default_factory=lambda: {
            "type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
            "beta_fast": 32, "beta_slow": 1,
        }
    )
    max_position_embeddings: int = 1_048_576
    bos_token_id: int = 0
    eos_token_id: int = 1
    # V4.1 has no per-head q RMS-norm (vLLM `enable_q_norm=False`, rtp-llm `skip_post_q_norm`).
    q_head_norm: bool = False
    # The model's own quantisation round-trips (ARCHITECTURE.md §12): on for `flash`.
    kv_qat: bool = False

    # ------------------------------------------------------------------ construction
    def __post_init__(self) -> None:
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                     "engram_layer_ids", "engram_num_embeddings"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(int(v) for v in value))
        from dsflash.model.config_checks import validate_config

        validate_config(self)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        from dsflash.model.presets import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
        return cls(**PRESETS[name])

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Accept our own layout or the released one (text fields nested under `text_config`)."""
        flat = dict(data.get("text_config", {}))
        flat.update({k: v for k, v in data.items() if k != "text_config" and k not in flat})
        if "engram_pad_id" in flat and "engram_pad_token_id" not in flat:  # transformers' name
            flat["engram_pad_token_id"] = flat.pop("engram_pad_id")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in flat.items() if k in known}
        n_layers = int(kwargs.get("num_hidden_layers", cls.num_hidden_layers))
        if "compress_ratios" in kwargs:
            # The release lists the 3 DSpark blocks after the backbone layers; they are out of scope.
            kwargs["compress_ratios"] = tuple(kwargs["compress_ratios"])[:n_layers]
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    # ------------------------------------------------------------------ derived values
    @property
    def first_decoder_layer(self) -> int:
        """CED split: layers [0, D) are the encoder, [D, L) the decoder (D = L/2)."""
        return self.num_hidden_layers // 2

    def is_decoder_layer(self, layer: int) -> bool:
        return layer >= self.first_decoder_layer

    def layer_ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def layer_role(self, layer: int) -> str:
        if self.compress_ratios[layer] == 0:
            return "window"
        if layer in self.kv_source_layer_ids:
            return "full"
        if layer in self.index_source_layer_ids:
            return "reindex"
        return "reuse"

    @property
    def layer_roles(self) -> tuple[str, ...]:
        return tuple(self.layer_role(i) for i in range(self.num_hidden_layers))

    def kv_source_of(self, layer: int) -> int | None:
        """The KV source a compressed layer reads: the latest one at or below it with its ratio."""
        return _latest_source(self.kv_source_layer_ids, layer, self.compress_ratios)

    def topk_source_of(self, layer: int) -> int | None:
        """The index source whose selection a layer uses (itself for Full / Reindex)."""
        return _latest_source(self.index_source_layer_ids, layer, self.compress_ratios)

    def uses_candidate_pool(self, layer: int) -> bool:
        cand = self.candidate_source_layer_id
        return (self.layer_role(layer) == "reindex" and layer > cand
                and self.compress_ratios[layer] == self.compress_ratios[cand])

    def rope_theta_of(self, layer: int) -> float:
        return self.rope_theta if self.compress_ratios[layer] == 0 else self.compress_rope_theta

    def uses_yarn(self, layer: int) -> bool:
        return self.compress_ratios[layer] != 0 and self.rope_scaling is not None

    @property
    def engram_orders(self) -> tuple[int, ...]:
        return tuple(range(2, self.engram_max_ngram_size + 1))

    @property
    def engram_heads_total(self) -> int:
        """Hashed rows per token per Engram layer: orders × heads per order."""
        return len(self.engram_orders) * self.engram_n_heads

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.o_groups


def _latest_source(sources: tuple[int, ...], layer: int, ratios: tuple[int, ...]) -> int | None:
    ratio = ratios[layer]
    if ratio == 0:
        return None
    found = [s for s in sources if s <= layer and ratios[s] == ratio]
    return max(found) if found else None
