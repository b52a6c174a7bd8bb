"""TensorRT registration of EngramHashGather (tensorrt.plugin AOT plugin).

`aot_kernel` compiles the Triton kernel of kernel.py to PTX for sm_90 with the launch parameters
TensorRT needs; it runs anywhere Triton is installed. `register()` adds the plugin to
tensorrt.plugin where TensorRT imports (the project's machines have no TensorRT builder; see
docs). Multipliers, primes, offsets and the pad id are baked into the PTX (AOT plugins do not
serialise attributes).
"""

from __future__ import annotations

import torch

from dsflash.plugins.aot import AotKernel, AotLaunch, cdiv_expr, compile_ptx, constant, pointer
from dsflash.plugins.declaration import DOMAIN
from dsflash.plugins.engram_hash_gather import kernel
from dsflash.plugins.engram_hash_gather.decl import DECL


def aot_kernel(table_dtype: torch.dtype, dim: int, multipliers, primes, offsets, pad_id: int,
               heads: int, aligned: bool = True) -> tuple[AotKernel, dict]:
    """(compiled kernel, launch: BLOCK_J for the grid (B*S, cdiv(look*heads, BLOCK_J)))."""
    look = len(multipliers) - 1
    cfg = kernel.launch_config(look, heads, dim)
    sig = {"cids_ptr": "*i64", "table_ptr": pointer(table_dtype), "n_new": "i32",
           "out_ptr": pointer(table_dtype)}
    consts = dict(LOOK=look, HEADS=heads, D=dim, MULT=tuple(map(int, multipliers)),
                  PRIMES=tuple(map(int, primes)), OFFSETS=tuple(map(int, offsets)), PAD_ID=int(pad_id),
                  BLOCK_J=cfg["BLOCK_J"], BLOCK_D=cfg["BLOCK_D"])
    return compile_ptx(kernel.engram_hash_gather_kernel, sig, consts, cfg["num_warps"], aligned=aligned), cfg


def aot_launch(cids_shape, table_shape, table_dtype: torch.dtype, multipliers, primes, offsets,
               pad_id: int, heads: int, aligned: bool = True) -> AotLaunch:
    """The launch for cids [B, look + S] and table [rows, D] (ints or TensorRT shape expressions)."""
    compiled, cfg = aot_kernel(table_dtype, constant(table_shape[1]), multipliers, primes, offsets, pad_id,
                               heads, aligned)
    look = len(multipliers) - 1
    n_new = cids_shape[1] - look
    return AotLaunch(compiled, (cids_shape[0] * n_new, cdiv_expr(look * heads, cfg["BLOCK_J"]), 1), (n_new,))


def register() -> None:
    """Register with tensorrt.plugin (needs TensorRT >= 10.8 with the Python plugin API)."""
    import numpy as np
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from dsflash.plugins.trt_types import io_types, torch_dtypes

    plugin_id = f"{DOMAIN}::{DECL.name}"

    @trtp.register(plugin_id)
    def _desc(cids: trtp.TensorDesc, table: trtp.TensorDesc, multipliers: np.ndarray, primes: np.ndarray,
              offsets: np.ndarray, pad_id: int, heads: int) -> trtp.TensorDesc:
        look = len(multipliers) - 1
        shape = (cids.shape_expr[0], cids.shape_expr[1] - look, look * heads, table.shape_expr[1])
        return trtp.from_shape_expr(shape, dtype=table.dtype)

    @trtp.autotune(plugin_id)
    def _tune(cids, table, multipliers, primes, offsets, pad_id, heads, outputs):
        return [trtp.AutoTuneCombination(io_types(DECL, "FP32|BF16|FP16"), "LINEAR")]

    @trtp.aot_impl(plugin_id)
    def _aot(cids: trtp.TensorDesc, table: trtp.TensorDesc, multipliers: np.ndarray, primes: np.ndarray,
             offsets: np.ndarray, pad_id: int, heads: int, outputs, tactic: int):
        return aot_launch(cids.shape_expr, table.shape_expr, torch_dtypes(trt)[table.dtype],
                          multipliers.tolist(), primes.tolist(), offsets.tolist(), pad_id,
                          heads).for_trt(trtp)
