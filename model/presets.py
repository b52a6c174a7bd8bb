"""Presets by exact name (ARCHITECTURE.md §10): `tiny` for CPU tests, `small` for one-GPU
benchmarks, `flash` for the released sizes (accounting on the meta device)."""

from __future__ import annotations

_YARN = {"type": "yarn", "beta_fast": 32, "beta_slow": 1}

PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=32, sliding_window=8,
        compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1), kv_source_layer_ids=(1, 4),
        index_source_layer_ids=(1, 4, 6), candidate_source_layer_id=4, candidate_topk_blocks=2,
        candidate_block_size=4, index_n_heads=2, index_head_dim=16, index_topk=4,
        engram_layer_ids=(1, 3), engram_num_embeddings=None, engram_n_heads=2, engram_head_dim=16,
        engram_vocab_size=257, engram_compressed_vocab_size=256, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        rope_scaling={**_YARN, "factor": 4.0, "original_max_position_embeddings": 16},
        max_position_embeddings=4096, kv_qat=False,
    ),
    "small": dict(
        vocab_size=32768, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
        head_dim=128, qk_rope_head_dim=32, q_lora_rank=384, o_groups=4, o_lora_rank=256,
        sliding_window=64, compress_ratios=(0, 0) + (2,) * 6 + (1,) * 8,
        kv_source_layer_ids=(2, 5, 8), index_source_layer_ids=(2, 5, 8, 12),
        candidate_source_layer_id=8, candidate_topk_blocks=64, candidate_block_size=8,
        index_n_heads=8, index_head_dim=64, index_topk=128, engram_layer_ids=(1, 5),
        engram_num_embeddings=None, engram_n_heads=4, engram_head_dim=64,
        engram_vocab_size=200003, engram_compressed_vocab_size=16384, n_routed_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=512, n_shared_experts=1,
        rope_scaling={**_YARN, "factor": 16.0, "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, kv_qat=False,
    ),
    # The released DeepSeek-V4.1-Flash sizes are the dataclass defaults; QAT round-trips on.
    "flash": dict(kv_qat=True),
}
