#!/usr/bin/env python3
"""Compile Csa2SparseAttention's batch form for sm_90 (64 heads of 512, bf16) and check how deep
Triton's software pipeline runs its two key loops. With the ids of the selected entries loaded in
the step that uses them, the pipeline copies ids and rows asynchronously and waits for every copy
at the top of each step (async_wait num = 0 at any num_stages): the gather of the next block
overlaps only the current block's last product. INDEX_AHEAD (the ids carried a step ahead in
registers) must leave num_stages - 2 row copies in flight in the selected loop, as the window loop
does; each setting must fit the H200's 227 KB of shared memory per program. Logs each setting's
copies in flight and shared memory (register spills come from ptxas: docs/benchmarks.md). Needs
Triton, not a GPU. Exit status 1 on a finding.

    python scripts/check_attention_pipeline.py
"""

from __future__ import annotations

import logging

from dsflash.plugins.csa2_sparse_attention.kernel import SM90_SHARED_BYTES

log = logging.getLogger("check_attention_pipeline")


def settings() -> dict:
    """name -> (BLOCK_K, num_stages, INDEX_AHEAD, PREFETCH): the launch default at 64 rows and the
    deeper pipelines the batch sweep compares."""
    return {"default (64 keys, 2 stages)": (64, 2, False, 0),
            "32 keys, 4 stages": (32, 4, False, 0),
            "32 keys, 3 stages, ids ahead": (32, 3, True, 0),
            "32 keys, 4 stages, ids ahead": (32, 4, True, 0),
            "32 keys, 4 stages, ids ahead, prefetch 4": (32, 4, True, 4),
            "16 keys, 8 stages, ids ahead": (16, 8, True, 0)}


def check() -> list[str]:
    import torch

    from dsflash.plugins.aot import compile_kernel, loop_async_waits
    from dsflash.plugins.csa2_sparse_attention import kernel, trt

    bf16 = torch.bfloat16
    sig = trt.kernel_signature(bf16)
    aligned = tuple(a for a, t in sig.items() if t.startswith("*"))
    base = {k: v for k, v in kernel.launch_config(64, 512, bf16, rows=64).items()
            if k not in ("num_warps", "num_stages")}
    problems = []
    for name, (keys, stages, ahead, prefetch) in settings().items():
        consts = base | {"H": 64, "D": 512, "SCALE": 512 ** -0.5, "SPLIT": True, "BLOCK_K": keys,
                         "INDEX_AHEAD": ahead, "PREFETCH": prefetch}
        compiled = compile_kernel(kernel.csa2_sparse_attention_kernel, sig, consts, 8, num_stages=stages,
                                  divisible_by_16=aligned)
        waits = loop_async_waits(compiled.asm["ttgir"])
        if len(waits) != 2 or not all(waits):
            problems.append(f"{name}: expected two loops that wait for copies, found {waits} (the TTGIR "
                            "pattern is out of date?)")
            continue
        selected, window = min(waits[0]), min(waits[1])
        if stages >= 3 and window < stages - 2:
            problems.append(f"{name}: the window loop waits with {window} copies in flight, expected "
                            f"{stages - 2}")
        if ahead and selected < stages - 2:
            problems.append(f"{name}: the selected loop waits with {selected} copies in flight, expected "
                            f"{stages - 2} with the ids a step ahead")
        if compiled.metadata.shared > SM90_SHARED_BYTES:
            problems.append(f"{name}: {compiled.metadata.shared} bytes of shared memory, over the H200's "
                            f"{SM90_SHARED_BYTES}")
        log.info("%-42s copies in flight at the wait: selected loop %d, window loop %d; %d B shared",
                 name, selected, window, compiled.metadata.shared)
    return problems


if __name__ == "__main__":
    import compile_check

    compile_check.run(check, __doc__)
