"""Programs that wait for each other inside one launch.

A program may only wait for another one that is running too; otherwise the waiting program holds
its SM while the one it waits for is never scheduled, and the launch hangs. A cooperative launch
(`launch_cooperative_grid=True` in Triton) guarantees that every program of the grid is resident
at once, and the driver refuses it with an error (never a hang) when the grid is larger than the
GPU holds. `resident_programs` says beforehand how many programs of a compiled kernel the GPU
holds, so a launcher can pick the waiting form only where it fits and fall back elsewhere.

Not for the Triton interpreter: it runs programs one after another, so a wait never returns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.aot import cdiv_expr as cdiv

REGISTER_UNIT = 256  # registers are allocated per warp in units of 256 (sm_90, CUDA occupancy calculator)
SM90_REGISTERS = 65536  # per SM, where torch's device properties do not say
RESERVED_SHARED = 1024  # shared memory the system reserves per block (sm_80 and later)


@triton.jit
def arrive_and_wait(count_ptr, generation_ptr, n):
    """A barrier of the n programs sharing these two int32 words; returns True in the last one to
    arrive. The count is back at 0 afterwards and the generation one higher (a barrier reused by
    the next launch needs no clearing). The caller orders its block's stores before it
    (tl.debug_barrier); the arrival is acq_rel and the wait acquires, so after it every program
    sees what every other one stored before arriving."""
    # read before arriving: the last program moves it only after every program has arrived
    generation = tl.atomic_add(generation_ptr, 0, sem="relaxed")
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel") == n - 1
    if last:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")
        tl.atomic_add(generation_ptr, 1, sem="release")
    else:
        seen = tl.atomic_add(generation_ptr, 0, sem="acquire")
        while seen == generation:
            seen = tl.atomic_add(generation_ptr, 0, sem="acquire")
    return last


def resident_programs(compiled, device: torch.device) -> int:
    """How many programs of a compiled Triton kernel the GPU runs at once (programs_per_gpu with
    the device's properties)."""
    if getattr(compiled, "n_regs", None) is None:
        compiled._init_handles()  # loads the binary: the register count is known from then on
    return programs_per_gpu(compiled, torch.cuda.get_device_properties(device))


def programs_per_gpu(compiled, props) -> int:
    """Per SM the least of what its registers, shared memory, threads and block slots allow (the
    CUDA occupancy calculator's rules), times the SMs. `compiled`: n_regs and metadata.num_warps
    and .shared; `props`: torch's CUDA device properties."""
    warps = compiled.metadata.num_warps
    regs_per_warp = cdiv(max(compiled.n_regs, 1) * 32, REGISTER_UNIT) * REGISTER_UNIT
    by_regs = getattr(props, "regs_per_multiprocessor", SM90_REGISTERS) // regs_per_warp // warps
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    by_shared = props.shared_memory_per_multiprocessor // (compiled.metadata.shared + RESERVED_SHARED)
    max_blocks = getattr(props, "max_blocks_per_multi_processor", 32)
    return props.multi_processor_count * min(by_regs, by_threads, by_shared, max_blocks)
