"""Programmatic dependent launch (PDL, sm_90 and later) for the kernels of a decode chain
(index scores -> top-k passes -> sparse attention): each kernel is launched with the
programmatic-serialization attribute, so the GPU may start launching it while the kernel before
it is still running, and its programs first wait (griddepcontrol.wait) until the earlier grid has
finished and its writes are visible, before any load or store. What is saved is the launch and
scheduling latency between dependent kernels, the floor under every decode-sized kernel
(scripts/bench_floor.py measures both).

Each program also signals (griddepcontrol.launch_dependents) right after its wait, so the next
kernel of the chain may be launched as soon as every program of this one has started. Its
programs then wait on the GPU, taking a slot each; since they are only scheduled once every
program of this grid has started, they never keep one of this grid's programs from running.

The TensorRT build compiles the kernels with PDL off (TensorRT launches them itself), as does
the Triton interpreter, which cannot run the inline PTX.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.launch import interpreting


@triton.jit
def wait_for_earlier_grids(PDL: tl.constexpr):
    """First statement of a PDL kernel: nothing it reads or writes may come before this."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_supported(device: torch.device) -> bool:
    return (device.type == "cuda" and not interpreting()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_launch_args(device: torch.device, overrides: dict | None = None) -> dict:
    """The kernel's PDL constant and Triton's launch option, on where the GPU has it;
    overrides {"PDL": False} turns it off (benchmarks compare both)."""
    on = bool((overrides or {}).get("PDL", True)) and pdl_supported(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
