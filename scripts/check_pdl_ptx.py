#!/usr/bin/env python3
"""Compile every kernel that launches with programmatic dependent launch (plugins/pdl.py) for
sm_90, with PDL on and off, and check its PTX: with PDL on, griddepcontrol.wait and
launch_dependents are there and no global load, store, atomic or async copy comes before the
wait (one would read data the kernel before may still be writing); with PDL off, neither
instruction is there (the TensorRT build). Needs Triton, not a GPU. Exit status 1 on a finding.

    python scripts/check_pdl_ptx.py
"""

from __future__ import annotations

import logging

log = logging.getLogger("check_pdl_ptx")


def check() -> list[str]:
    from dsflash.plugins.aot import compile_ptx
    from dsflash.plugins.pdl import memory_before_wait, pdl_kernel_specs

    problems = []
    for name, (kernel, signature, constants, *options) in pdl_kernel_specs().items():
        build = {"num_warps": 4} | (options[0] if options else {})
        on = compile_ptx(kernel, signature, constants | {"PDL": True}, **build).ptx
        off = compile_ptx(kernel, signature, constants | {"PDL": False}, **build).ptx
        early = memory_before_wait(on)
        if "griddepcontrol.wait" not in on or "griddepcontrol.launch_dependents" not in on:
            problems.append(f"{name}: PDL on, but no griddepcontrol.wait / launch_dependents in its PTX")
        if early:
            problems.append(f"{name}: {len(early)} memory instructions before griddepcontrol.wait, "
                            f"first {early[0]}")
        if "griddepcontrol" in off:
            problems.append(f"{name}: PDL off, but griddepcontrol in its PTX")
        found = memory_before_wait(off)  # no wait: every global memory instruction of the kernel
        if not found:
            problems.append(f"{name}: no global memory instruction recognised in its PTX (the pattern "
                            "is out of date)")
        log.info("%-18s PDL on: %d of its %d global memory instructions before the wait; PDL off: %s",
                 name, len(early), len(found),
                 "clean" if "griddepcontrol" not in off else "HAS griddepcontrol")
    return problems


if __name__ == "__main__":
    import compile_check

    compile_check.run(check, __doc__)
