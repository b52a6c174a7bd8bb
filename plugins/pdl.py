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

import re

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


def memory_before_wait(ptx: str) -> list[str]:
    """The global-memory instructions (loads, stores, atomics, async copies) a kernel's PTX issues
    before its first griddepcontrol.wait, in order; all of them when there is no wait. Parameter
    loads (ld.param) do not count: the launch fixes them. Empty for a correct PDL kernel."""
    body = ptx.split(".entry", 1)[-1]
    wait = body.find("griddepcontrol.wait")
    head = body if wait < 0 else body[:wait]
    memory = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st|atom|red)(?:\.\w+)*\.global\S*|cp\.async\S*)", re.M)
    return [m.group(1) for m in memory.finditer(head)]


def pdl_kernel_specs() -> dict:
    """The kernels that launch with PDL, each as (kernel, signature, constants) at the release
    sizes, for scripts/check_pdl_ptx.py."""
    from dsflash.plugins.csa2_index_score import fp4_mma
    from dsflash.plugins.csa2_index_score import kernel as index
    from dsflash.plugins.csa2_sparse_attention import kernel as attention
    from dsflash.plugins.stable_topk import kernel as topk

    index_sig = {"q_ptr": "*bf16", "w_ptr": "*fp32", "vis_ptr": "*u8", "S": "i32", "N": "i32",
                 "out_ptr": "*fp32"}
    index_consts = {"I": 32, "J": 128, "BLOCK_N": 64, "BLOCK_I": 32, "BLOCK_J": 128, "IEEE": False}
    topk_sig = {"scores_ptr": "*fp32", "N": "i32", "k": "i32", "hist": "*i32", "state": "*i64",
                "counter": "*i32", "prog_hist": "*i32", "sel": "*u64", "vals_ptr": "*fp32",
                "idx_ptr": "*i64"}
    attn_sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i64", "win_ptr": "*bf16",
                "wmask_ptr": "*u8", "sink_ptr": "*fp32", "S": "i32", "N": "i32", "T": "i32", "K": "i32",
                "blocks_per_split": "i32", "out_ptr": "*bf16", "ws_acc": "*fp32", "ws_ml": "*fp32"}
    return {
        "index": (index.csa2_index_score_kernel, index_sig | {"k_ptr": "*bf16"}, index_consts),
        "index_fp4": (index.csa2_index_score_fp4_kernel,
                      index_sig | {"codes_ptr": "*u8", "exps_ptr": "*i8"}, index_consts),
        "index_fp4_mma": (fp4_mma.csa2_index_score_fp4_mma_kernel,
                          index_sig | {"codes_ptr": "*u8", "exps_ptr": "*i8"},
                          {"I": 32, "J": 128, "JP": 128, "BLOCK_N": 64, "BLOCKS": 4, "ASM": True}),
        "topk_digit_pass": (topk.radix_digit_pass_kernel, topk_sig,
                            {"SHIFT": 8, "BITS": 8, "PASS": 2, "FIRST": False, "LAST": False, "CHUNK": 512,
                             "HIST_BINS": 256, "SLOTS": 6}),
        "topk_select": (topk.radix_select_kernel, topk_sig,
                        {"CHUNK": 512, "KP": 512, "PP": 256, "LAST_BITS": 8, "SLOTS": 6, "ALLOC": 4}),
        "attention_split": (attention.csa2_sparse_attention_kernel, attn_sig,
                            {"H": 64, "D": 512, "SCALE": 512 ** -0.5, "BLOCK_H": 16, "BLOCK_K": 32,
                             "BLOCK_D": 512, "SPLIT": True, "IEEE": False}),
        "attention_combine": (attention.csa2_attention_combine_kernel,
                              {"ws_acc": "*fp32", "ws_ml": "*fp32", "sink_ptr": "*fp32", "n_split": "i32",
                               "out_ptr": "*bf16"},
                              {"H": 64, "D": 512, "BLOCK_H": 16, "BLOCK_D": 512, "NSP": 32}),
    }
