#!/usr/bin/env python3
"""Compile MhcBoundary for sm_90 with the launch configurations the JIT launcher and the TensorRT
plugin use (flash sizes: hidden 5120, 4 streams, bf16) and check what Triton's software pipeline
copies into shared memory ahead of the channel loop: tiles of streams, y and fn (2-D), never
per-row vectors (1-D). The rows' coefficients, loaded per chunk, were pipelined as 4-byte copies,
24 of a thread's 37 copies per chunk, and the kernel took 635 us instead of 503 at 8,192 tokens
(H200, docs/benchmarks.md). It also checks that the tensor-core projection's operand is R'
converted once, not stream tiles (Triton recomputing R' in the operand's layout). Needs Triton,
not a GPU. Exit status 1 on a finding.

    python scripts/check_mhc_loads.py
"""

from __future__ import annotations

import logging

log = logging.getLogger("check_mhc_loads")


def cases() -> dict:
    """name -> (signature, constants, num_warps, num_stages, aligned parameters), as each path
    launches the kernel (the JIT sees 16-byte aligned tensors and, at these sizes, token and chunk
    counts that are multiples of 16)."""
    import torch

    from dsflash.plugins.mhc_boundary import kernel, trt

    bf16, hc, hidden = torch.bfloat16, 4, 5120
    sig = trt.kernel_signature(bf16)
    out = {}
    paths = (("decode (1 token, channel splits)", 1, False, 256),
             ("prefill (row blocks with channel splits)", 8192, False, 2),
             ("whole rows (the TensorRT plugin's blocks)", 1 << 20, True, 1))
    for name, tokens, whole_rows, n_split_p2 in paths:
        cfg = kernel.launch_config(tokens, hc, hidden, bf16)
        consts = trt.kernel_constants(cfg, hc, hidden, 20, 1e-6, 1e-6, split=not whole_rows,
                                      n_split_p2=n_split_p2)
        aligned = tuple(a for a, t in sig.items() if t.startswith("*")) + ("T", "chunks_per_split")
        out[name] = (sig, consts, cfg["num_warps"], cfg.get("num_stages"), aligned)
    return out


def check() -> list[str]:
    from dsflash.plugins.aot import compile_kernel, operand_loads, pipelined_copies
    from dsflash.plugins.mhc_boundary.kernel import mhc_boundary_kernel

    problems = []
    for name, (sig, consts, warps, stages, aligned) in cases().items():
        ttgir = compile_kernel(mhc_boundary_kernel, sig, consts, warps, num_stages=stages,
                               divisible_by_16=aligned).asm["ttgir"]
        copies = pipelined_copies(ttgir)
        # per-row vectors: [BLOCK_T] fp32 (the coefficients' dtype); the RMSNorm loop's weight
        # vector ([NORM_E], the stream dtype) is pipelined on purpose
        vectors = [c for c in copies if c[0] == (consts["BLOCK_T"],) and c[1] == "f32"]
        tiles = [c for c in copies if len(c[0]) == 2]
        if vectors:
            problems.append(f"{name}: {len(vectors)} pipelined per-row vector loads, e.g. {vectors[0]}: "
                            "load row constants once, before the channel loop")
        # the dot's A operand must be R' (fp32, converted once), never a stream tile (the stream
        # dtype): that is Triton recomputing R' in the operand layout (568.8 against 408.1 us,
        # H200, session 8)
        recomputed = [o for o in operand_loads(ttgir) if o[2] == 0 and o[1] != "f32"]
        if recomputed:
            problems.append(f"{name}: {len(recomputed)} stream tiles loaded into the dot's operand layout, "
                            f"e.g. {recomputed[0]}: R' is computed twice (see _computed_once)")
        if consts["BLOCK_T"] >= 16 and not tiles:
            problems.append(f"{name}: no pipelined tile loads found (the TTGIR pattern is out of date?)")
        log.info("%-40s %2d async copies: %d tiles %s, %d row vectors, %d recomputed operands", name,
                 len(copies), len(tiles), sorted({f"{'x'.join(map(str, s))} {e}" for s, e in tiles}),
                 len(vectors), len(recomputed))
    return problems


if __name__ == "__main__":
    import compile_check

    compile_check.run(check, __doc__)
