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
    """The global-memory instructions (loads, stores, atomics, prefetches, async copies) a kernel's
    PTX issues before its first griddepcontrol.wait, in order; all of them when there is no wait.
    Parameter loads (ld.param) do not count: the launch fixes them. Empty for a correct PDL kernel."""
    body = ptx.split(".entry", 1)[-1]
    wait = body.find("griddepcontrol.wait")
    head = body if wait < 0 else body[:wait]
    memory = re.compile(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st|atom|red)(?:\.\w+)*\.global\S*|cp\.async\S*)",
                        re.MULTILINE)
    # prefetch hints come from inline asm ({ ...; @p prefetch.global.L2 [..]; }), mid-line
    hints = re.compile(r"\b(prefetch(?:\.\w+)*\.global\S*)")
    found = [(m.start(), m.group(1)) for m in (*memory.finditer(head), *hints.finditer(head))]
    return [name for _, name in sorted(found)]


def pdl_kernel_specs() -> dict:
    """The kernels that launch with PDL, each as (kernel, signature, constants) at the release
    sizes (bf16; launch parameters from each launcher's launch_config), or (kernel, signature,
    constants, compile_ptx's options) where the build is not its default of 4 warps (the Gluon
    attention: 8 warps, its register cap, and 16-byte aligned pointers, which its copies need),
    for scripts/check_pdl_ptx.py."""
    from dsflash.plugins.csa2_index_score import fp4_mma, pool_list, pooled, pooled_fp4
    from dsflash.plugins.csa2_index_score import kernel as index
    from dsflash.plugins.csa2_index_score import trt as index_trt
    from dsflash.plugins.csa2_sparse_attention import entries_fp4, gluon_batch, splits
    from dsflash.plugins.csa2_sparse_attention import kernel as attention
    from dsflash.plugins.csa2_sparse_attention import trt as attention_trt
    from dsflash.plugins.csa2_sparse_attention import trt_entries_fp4 as entries_trt
    from dsflash.plugins.csa2_sparse_attention import trt_split as attention_split_trt
    from dsflash.plugins.stable_topk import kernel as topk
    from dsflash.plugins.stable_topk import prefilter

    def constants(cfg: dict) -> dict:
        return {k: v for k, v in cfg.items() if k not in ("num_warps", "num_stages")}

    bf16 = torch.bfloat16
    index_sig = index_trt.kernel_signature(bf16)
    index_consts = {"I": 32, "J": 128} | constants(index.launch_config(32, 128, bf16))
    fp4_sig = {k: v for k, v in index_sig.items() if k != "k_ptr"} | {"codes_ptr": "*u8", "exps_ptr": "*i8"}
    topk_sig = {"scores_ptr": "*fp32", "N": "i32", "k": "i32", "hist": "*i32", "state": "*i64",
                "counter": "*i32", "prog_hist": "*i32"}
    rank_sig = {"scores_ptr": "*fp32", "N": "i32", "k": "i32", "hist": "*i32", "counter": "*i32",
                "sel": "*u64", "vals_ptr": "*fp32", "idx_ptr": "*i64", "entries_ptr": "*i64", "W": "i32"}
    block_max_rank_sig = {"scores_ptr": "*fp32", "N": "i32", "k": "i32", "hist": "*i32", "counter": "*i32",
                          "prog_eq": "*i32", "cand": "*u64", "tval": "*i64", "vals_ptr": "*fp32",
                          "idx_ptr": "*i64", "CAP": "i32", "entries_ptr": "*i64", "W": "i32"}
    attn_cfg = constants(attention.launch_config(64, 512, bf16))
    pooled_sig = {"q_ptr": index_sig["q_ptr"], "w_ptr": index_sig["w_ptr"], "k_ptr": index_sig["k_ptr"],
                  "entries_ptr": "*i32", "S": "i32", "N": "i32", "P": "i32", "out_ptr": "*fp32",
                  "bm_ptr": "*fp32"}
    maxima_passes_sig = {"bm_ptr": "*fp32", "M": "i32", "k": "i32", "hist": "*i32", "state": "*i64",
                         "tval": "*i64", "CAP": "i32", "counter": "*i32"}
    list_sig = {"member_ptr": "*u8", "counts_ptr": "*i32", "N": "i32", "P": "i32", "SEGS": "i32",
                "PAD": "i32", "out_ptr": "*i32"}
    picks_sig = {"vals_ptr": "*fp32", "pos_ptr": "*i64", "entries_ptr": "*i32", "K": "i32", "P": "i32",
                 "W": "i32", "out_ptr": "*i64"}
    return {
        "index_pooled": (pooled.csa2_index_score_pooled_kernel, pooled_sig,
                         index_consts | constants(pooled.listed_pipelined_launch())),
        # ... writing the block maxima of its scores for the top-k (listed_ids_with_maxima)
        "index_pooled_maxima": (pooled.csa2_index_score_pooled_kernel, pooled_sig,
                                index_consts | constants(pooled.listed_pipelined_launch())
                                | {"MAX_BLOCK": 8}),
        "pool_counts": (pool_list.pool_segment_counts_kernel,
                        {"member_ptr": "*u8", "N": "i32", "SEGS": "i32", "counts_ptr": "*i32"},
                        {"SEG": 4096}),
        "pool_list": (pool_list.pool_entry_list_kernel, list_sig, {"SEG": 4096, "SEGS_P2": 32}),
        "listed_picks": (pool_list.listed_picks_kernel, picks_sig, {"BLOCK": 512}),
        "index": (index.csa2_index_score_kernel, index_sig, index_consts),
        "index_pipelined": (index.csa2_index_score_kernel, index_sig,
                            index_consts | constants(index.pipelined_launch())),
        "index_fp4": (index.csa2_index_score_fp4_kernel, fp4_sig, index_consts),
        "index_fp4_mma": (fp4_mma.csa2_index_score_fp4_mma_kernel, fp4_sig,
                          {"I": 32, "J": 128, "JP": 128, "BLOCK_N": 64, "BLOCKS": 4, "ASM": True}),
        "index_fp4_pooled": (pooled_fp4.csa2_index_score_fp4_pooled_kernel,
                             {"q_ptr": index_sig["q_ptr"], "w_ptr": index_sig["w_ptr"], "codes_ptr": "*u8",
                              "exps_ptr": "*i32", "entries_ptr": "*i32", "S": "i32", "N": "i32", "P": "i32",
                              "out_ptr": "*fp32", "bm_ptr": "*fp32"},
                             {"I": 32, "J": 128, "JP": 128, "BLOCK_N": 128, "BLOCKS": 16, "STAGES": 3,
                              "ASM": True, "EXP_WORDS": True}),
        "topk_digit_pass": (topk.radix_digit_pass_kernel, topk_sig,
                            {"SHIFT": 8, "BITS": 8, "PASS": 2, "PREV_BITS": 8, "LAST": False, "CHUNK": 512,
                             "HIST_BINS": 256, "PASSES": 4}),
        "topk_select": (topk.radix_select_kernel, topk_sig | {"sel": "*u64"},
                        {"CHUNK": 512, "KP": 512, "PP": 256, "LAST_BITS": 8, "HIST_BINS": 256, "PASSES": 4}),
        "topk_rank": (topk.radix_rank_kernel, rank_sig,
                      {"KP": 512, "RANK_BLOCK": 4, "CMP_BLOCK": 256, "HIST_BINS": 256, "PASSES": 4}),
        "topk_block_max_pass": (prefilter.block_max_pass_kernel,
                                {"scores_ptr": "*fp32", "N": "i32", "M": "i32", "k": "i32", "hist": "*i32",
                                 "state": "*i64", "counter": "*i32", "bm_ptr": "*fp32"},
                                {"SHIFT": 24, "BITS": 8, "CHUNK": 64, "BLOCK": 8, "HIST_BINS": 256,
                                 "PASSES": 4}),
        "topk_maxima_passes": (prefilter.maxima_passes_kernel, maxima_passes_sig,
                               {"WIDTHS": 0x8888, "MP": 2048, "BLOCK": 8, "SLACK": 32, "HIST_BINS": 256,
                                "PASSES": 4}),
        # ... with the first pass, over maxima the listed index kernel wrote (listed_ids_with_maxima)
        "topk_maxima_passes_first": (prefilter.maxima_passes_kernel, maxima_passes_sig,
                                     {"WIDTHS": 0x8888, "MP": 2048, "BLOCK": 8, "SLACK": 32, "HIST_BINS": 256,
                                      "PASSES": 4, "FIRST": True}),
        "topk_collect": (prefilter.prefilter_collect_kernel,
                         {"scores_ptr": "*fp32", "N": "i32", "hist": "*i32", "state": "*i64",
                          "counter": "*i32", "prog_eq": "*i32", "cand": "*u64", "tval": "*i64", "CAP": "i32"},
                         {"CHUNK": 512, "LAST_BITS": 8, "HIST_BINS": 256, "PASSES": 4}),
        # the threshold the fused passes left (maxima_passes_kernel's stop)
        "topk_collect_given": (prefilter.prefilter_collect_kernel,
                               {"scores_ptr": "*fp32", "N": "i32", "hist": "*i32", "state": "*i64",
                                "counter": "*i32", "prog_eq": "*i32", "cand": "*u64", "tval": "*i64",
                                "CAP": "i32"},
                               {"CHUNK": 512, "LAST_BITS": 8, "HIST_BINS": 256, "PASSES": 4, "T_GIVEN": True}),
        "topk_collect_live": (prefilter.prefilter_collect_live_kernel,
                              {"scores_ptr": "*fp32", "N": "i32", "M": "i32", "bm_ptr": "*fp32", "live_ptr": "*i32",
                               "hist": "*i32", "state": "*i64", "counter": "*i32", "prog_eq": "*i32",
                               "cand": "*u64", "tval": "*i64", "CAP": "i32"},
                              {"CHUNK": 512, "BLOCK": 16, "LIVE_BLOCKS": 32, "LAST_BITS": 8, "HIST_BINS": 256,
                               "PASSES": 4}),
        "topk_block_max_rank": (prefilter.prefilter_rank_kernel, block_max_rank_sig,
                                {"RANK_PROGS": 128, "RANK_BLOCK": 4, "CMP_BLOCK": 256, "CHUNK": 512,
                                 "PP": 256, "HIST_BINS": 256, "PASSES": 4}),
        "topk_block_max_rank_ties": (prefilter.prefilter_rank_kernel, block_max_rank_sig,
                                     {"RANK_PROGS": 32, "RANK_BLOCK": 16, "CMP_BLOCK": 256, "CHUNK": 2048,
                                      "PP": 64, "HIST_BINS": 256, "PASSES": 4, "TIES_IN_RANK": True}),
        # a listed pool's top-k writing its entry ids (StableTopkLauncher.listed_ids), its steps'
        # keys loaded into the compare's tile a step ahead (the default at 16-64 rows: _rank_load)
        "topk_block_max_rank_listed": (
            prefilter.prefilter_rank_kernel, block_max_rank_sig | {"entries_ptr": "*i32"},
            {"RANK_PROGS": 128, "RANK_BLOCK": 8, "CMP_BLOCK": 64, "CHUNK": 512, "PP": 32, "HIST_BINS": 256,
             "PASSES": 4, "TIES_IN_RANK": True, "LISTED": True, "RANK_TILE": True, "RANK_AHEAD": True}),
        "attention_split": (attention.csa2_sparse_attention_kernel, attention_trt.kernel_signature(bf16),
                            {"H": 64, "D": 512, "SCALE": 512 ** -0.5, "SPLIT": True} | attn_cfg),
        # the batch form of many rows (64-key blocks) ...
        "attention_batch": (attention.csa2_sparse_attention_kernel, attention_trt.kernel_signature(bf16),
                            {"H": 64, "D": 512, "SCALE": 512 ** -0.5, "SPLIT": True}
                            | constants(attention.launch_config(64, 512, bf16, rows=splits.AHEAD_ROWS + 1))),
        # ... and of up to 64 rows (32-key blocks, the ids a loop step ahead), with L2 hints ahead
        "attention_gather_ahead": (
            attention.csa2_sparse_attention_kernel, attention_trt.kernel_signature(bf16),
            {"H": 64, "D": 512, "SCALE": 512 ** -0.5, "SPLIT": True}
            | constants(attention.launch_config(64, 512, bf16, rows=64))
            | {"BLOCK_K": 32, "INDEX_AHEAD": True, "PREFETCH": 4}),
        # the warp-specialized Gluon form from GLUON_ROWS rows (split, 64-key blocks in 2 stages), as
        # launched under {"PDL": True} (off by default: kernel.gluon_launch_pdl)
        "attention_gluon": (gluon_batch.csa2_sparse_attention_ws_kernel,
                            {k: v for k, v in attention_trt.kernel_signature(bf16).items() if k != "out_ptr"},
                            {"H": 64, "D": 512, "SCALE": 512 ** -0.5, "KB": 64, "STAGES": 2, "SPLIT": True,
                             "out_ptr": None, "num_warps": 8},
                            {"num_warps": 8, "maxnreg": gluon_batch.MAXNREG, "aligned": True}),
        # kv_qat's FP4 entries: the selected rows decoded for the attention
        "entries_fp4": (entries_fp4.csa2_entries_fp4_kernel, entries_trt.kernel_signature(bf16),
                        {"C": 256, "CP": 256, "ROWS": entries_fp4.ROWS}),
        "attention_combine": (attention.csa2_attention_combine_kernel,
                              attention_split_trt.combine_signature(bf16),
                              {"H": 64, "D": 512, "NSP": 32, "BLOCK_D": attn_cfg["BLOCK_D"]}),
    }
