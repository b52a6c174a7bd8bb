"""Ahead-of-time kernels of a model's plugin ops: for every custom node the plugin-flavor graphs
hold (one Engram gather per Engram layer, the CSA2 ops, the mHC boundary and its split form), the
sm_90 PTX and launch parameters that the trt.py registrations hand TensorRT. Written beside a bundle's plans
(`kernels/`) so a build can be checked without TensorRT; needs Triton, no GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dsflash.model.config import ModelConfig
from dsflash.model.engram_hash import layer_addressing, synthetic_compression_map
from dsflash.plugins.aot import AotKernel


def plugin_kernels(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, vocab_map=None) -> dict[str, tuple]:
    """name -> (AotKernel, launch config) for every distinct kernel the model's plugin graphs use
    (each tactic of a plugin with several: <op>_tactic<n>, the first tactic under the op's name)."""
    from dsflash.plugins.csa2_index_score import trt as index_trt
    from dsflash.plugins.csa2_index_score import trt_fp4 as index_fp4_trt
    from dsflash.plugins.csa2_sparse_attention import splits
    from dsflash.plugins.csa2_sparse_attention import trt as attn_trt
    from dsflash.plugins.csa2_sparse_attention import trt_entries_fp4 as entries_fp4_trt
    from dsflash.plugins.csa2_sparse_attention import trt_split as attn_split_trt
    from dsflash.plugins.engram_hash_gather import trt as engram_trt
    from dsflash.plugins.mhc_boundary import splits as mhc_splits
    from dsflash.plugins.mhc_boundary import trt as mhc_trt
    from dsflash.plugins.mhc_boundary import trt_split as mhc_split_trt

    kernels = {}
    if vocab_map is None:
        vocab_map = synthetic_compression_map(cfg.vocab_size, cfg.engram_compressed_vocab_size)
    addressing = layer_addressing(cfg, vocab_map) if cfg.engram_layer_ids else {}
    for layer, a in addressing.items():
        kernels[f"EngramHashGather_layer{layer}"] = engram_trt.aot_kernel(
            dtype, cfg.engram_head_dim, a.multipliers, a.primes, a.offsets, a.pad_id, cfg.engram_n_heads)
    if cfg.kv_qat:  # the index keys are FP4 in the state (model/cache.py): Csa2IndexScoreFp4 nodes
        for tactic in index_fp4_trt.tactics(dtype, cfg.index_n_heads):
            kernels[_tactic_name("Csa2IndexScoreFp4", tactic)] = index_fp4_trt.aot_kernel(
                dtype, cfg.index_n_heads, cfg.index_head_dim, tactic)
    for tactic in [] if cfg.kv_qat else index_trt.tactics(dtype, cfg.index_head_dim):  # TensorRT times each
        kernels[_tactic_name("Csa2IndexScore", tactic)] = index_trt.aot_kernel(
            dtype, cfg.index_n_heads, cfg.index_head_dim, tactic)
    for tactic in attn_trt.tactics(dtype, cfg.num_attention_heads, cfg.head_dim):
        kernels[_tactic_name("Csa2SparseAttention", tactic)] = attn_trt.aot_kernel(
            dtype, cfg.num_attention_heads, cfg.head_dim, cfg.head_dim ** -0.5,
            overrides=attn_trt.tactic_overrides(tactic, dtype, cfg.num_attention_heads, cfg.head_dim))
    heads, dim = cfg.num_attention_heads, cfg.head_dim
    if cfg.kv_qat:  # the entries are FP4 in the state too: Csa2EntriesFp4 nodes decode them
        kernels["Csa2EntriesFp4"] = entries_fp4_trt.aot_kernel(dtype, dim)
    block_keys = splits.export_attrs(heads, dim)["block_keys"]
    for tactic in attn_split_trt.tactics(dtype, heads, dim, block_keys):  # decoder_step's split form
        kernels[_tactic_name("Csa2SparseAttentionSplit", tactic)] = attn_split_trt.split_kernel(
            dtype, heads, dim, dim ** -0.5, block_keys, tactic)
    for tactic in attn_split_trt.combine_tactics():
        kernels[_tactic_name("Csa2AttentionCombine", tactic)] = attn_split_trt.combine_kernel(
            dtype, heads, dim, tactic=tactic)
    for tactic in mhc_trt.tactics(cfg.hc_mult, cfg.hidden_size, dtype):
        hint, over = mhc_trt.tactic_setting(tactic)
        kernels[_tactic_name("MhcBoundary", tactic)] = mhc_trt.aot_kernel(
            dtype, hint, cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps,
            overrides=over)
    block_e = mhc_splits.export_attrs(cfg.hidden_size)["block_e"]
    for tactic in mhc_split_trt.partials_tactics():  # decoder_step's split form
        kernels[_tactic_name("MhcBoundaryPartials", tactic)] = mhc_split_trt.partials_kernel(
            dtype, cfg.hc_mult, cfg.hidden_size, block_e, tactic)
    for tactic in mhc_split_trt.finish_tactics():
        kernels[_tactic_name("MhcBoundaryFinish", tactic)] = mhc_split_trt.finish_kernel(
            dtype, cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, tactic)
    return kernels


def _tactic_name(op: str, tactic: int) -> str:
    return op if tactic == 1 else f"{op}_tactic{tactic}"


def write_plugin_kernels(kernels: dict[str, tuple], out_dir: Path) -> Path:
    """<name>.ptx per kernel and kernels.json with names, warps, shared memory and block sizes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    index = {}
    for name, (k, cfg) in kernels.items():
        assert isinstance(k, AotKernel)
        (out_dir / f"{name}.ptx").write_text(k.ptx)
        index[name] = {"entry": k.name, "num_warps": k.num_warps, "block_x": k.block_x,
                       "shared_mem": k.shared_mem, "params": k.params, "declared": k.declared,
                       "global_scratch": k.global_scratch, "aligned": k.aligned, "launch": cfg,
                       "arch": "sm_90"}
    path = out_dir / "kernels.json"
    path.write_text(json.dumps(index, indent=1, sort_keys=True))
    return path
