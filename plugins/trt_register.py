"""Register every plugin with tensorrt.plugin (the trt.py beside each kernel). Needs TensorRT's
Python plugin API (TensorRT >= 10.8) and Triton for the ahead-of-time compile."""

from __future__ import annotations


def register_trt_plugins() -> list[str]:
    import tensorrt.plugin as trtp  # noqa: F401

    from dsflash.plugins.csa2_index_score import trt as index_trt
    from dsflash.plugins.csa2_index_score import trt_fp4 as index_fp4_trt
    from dsflash.plugins.csa2_sparse_attention import trt as attn_trt
    from dsflash.plugins.csa2_sparse_attention import trt_entries_fp4 as entries_fp4_trt
    from dsflash.plugins.csa2_sparse_attention import trt_split as attn_split_trt
    from dsflash.plugins.declaration import DOMAIN
    from dsflash.plugins.engram_hash_gather import trt as engram_trt
    from dsflash.plugins.mhc_boundary import trt as mhc_trt
    from dsflash.plugins.mhc_boundary import trt_split as mhc_split_trt
    from dsflash.plugins.registry import DECLS

    for module in (engram_trt, index_trt, index_fp4_trt, attn_trt, attn_split_trt, entries_fp4_trt, mhc_trt,
                   mhc_split_trt):
        module.register()  # tensorrt.plugin refuses a second registration: call once per process
    return [f"{DOMAIN}::{d.name}" for d in DECLS]
