#!/usr/bin/env python3
"""CSA2 decode attention layers at a decode batch (PIPELINE.md §8): B query rows, each over its
own sequence of `ctx` cached entries, as a served decode step runs them. bench_kernels.py times one
row, where every layer is a chain of ~1 us launches (index 1, top-k 6, attention 2) that moves a
few MB; here the same launches carry B rows, so the bytes grow and the launch cost does not.

Per batch and context, with the released sizes (64 heads x 512, index 32 x 128, top-k 512, window
128, candidate pool 2048 blocks x 8):
- Full layer (index every entry, top-k, attention) with bf16 index keys and with the release's FP4
  index keys (68 B per entry, `csa2_index_score_fp4`); Reindex over the pool as a mask (the index
  kernel skips unpooled keys, the top-k ranks all entries) and as a list (OpSet("triton")'s form:
  only the pooled entries are scored and ranked, csa2_index_score_pooled; listing the pool is once
  per step for all its Reindex layers, timed apart), the list also over the FP4 keys
  (csa2_index_score_fp4_pooled); Reuse (attention over another layer's selection);
- the attention over kv_qat's FP4 entries: the selected rows decoded (csa2_entries_fp4), then the
  attention over them, as OpSet.csa2_sparse_attention_fp4 and the graphs run a decode step;
- each kernel alone and its fraction of its own roofline (counted bytes at the measured copy
  bandwidth); the top-k's bytes are one read of its scores and its k outputs per row;
- the dense roofline: every row's uncompressed KV (ctx x 512 bf16) read once, and the layers'
  speed-up over it, as issue 5's targets state it (3x Full, 15x Reindex / Reuse).

Times are medians of CUDA-graph replays back to back; at B >= 2 and 128K the index keys (B x 32 MB)
no longer fit in the 50 MB L2, so those read from HBM. `--cold` also times one replay after a 256 MB
read (bench_kernels.time_cold_ms). The top-k kernel's picks are checked against the stable sort
on every case (a warning and `topk_exact: false` in the JSON if they differ).

    python scripts/bench_layer_batch.py --out gpu_out [--batches 1,8,32,64] [--contexts 131072]
    python scripts/bench_layer_batch.py --out gpu_out --batches 1,64 --topk-digits 8-8-8-8,4-4-8-8-8
    python scripts/bench_layer_batch.py --out gpu_out --batches 4,16,64 --topk-blocks 8,16 --topk-kinds listed
    python scripts/bench_layer_batch.py --out gpu_out --batches 1,64 --fp4-configs 64:4:4:0,128:16:8:3
    python scripts/bench_layer_batch.py --out docs --plot-from gpu_out/bench_layer_batch.json  # any machine

A layer run also draws bench_layer_batch.png (plot): each layer's speed-up over the dense roofline
and each kernel's roofline fraction against the rows, with issue 5's targets.

The sweeps replace the layer timings: the top-k's chunks and digit splits (each checked bit for bit
against the stable sort) and the FP4 index kernel's launch configs (each compared with the launch
default's scores), with their fractions of the roofline.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
import triton
from bench_kernels import (
    BF16,
    CAND_BLOCK,
    CAND_BLOCKS,
    HEAD_DIM,
    HEADS,
    INDEX_DIM,
    INDEX_HEADS,
    TOPK,
    WINDOW,
    attn_bytes,
    ceilings,
    index_bytes,
    time_cold_ms,
    time_ms,
)
from tqdm import tqdm
from triton.runtime.errors import OutOfResources

from dsflash.model import csa2_ops
from dsflash.model.csa2_ops import select_topk
from dsflash.model.quant import fp4_pow2_pack, fp4_pow2_qat
from dsflash.plugins.csa2_index_score import kernel as index_kernel
from dsflash.plugins.csa2_index_score.pool_list import pool_entry_list
from dsflash.plugins.csa2_index_score.pooled import csa2_index_score_pooled, csa2_index_score_pooled_maxima
from dsflash.plugins.csa2_index_score.pooled_fp4 import (
    csa2_index_score_fp4_pooled,
    csa2_index_score_fp4_pooled_maxima,
)
from dsflash.plugins.csa2_sparse_attention import kernel as attn_kernel
from dsflash.plugins.csa2_sparse_attention.entries_fp4 import csa2_entries_fp4
from dsflash.plugins.launch import is_pow2
from dsflash.plugins.stable_topk.kernel import StableTopkLauncher, digit_passes
from dsflash.plugins.stable_topk.reference import stable_topk as stable_topk_reference

log = logging.getLogger("bench_layer_batch")
LAYERS = ("full", "full_fp4", "reindex", "reindex_listed", "reindex_listed_fp4", "reuse")
# the speed-up over the dense roofline issue 5 asks of each layer
TARGETS = {"full": 3.0, "full_fp4": 3.0, "reindex": 15.0, "reindex_listed": 15.0, "reindex_listed_fp4": 15.0,
           "reuse": 15.0}
# --fp4-queries: the FP4 layers' index queries, as kv_qat rounds them (the model's) or bf16 ones
# (what sessions 19-35 ran; docs/benchmarks.md, session 36: the same kernel took 342.9 us on bf16
# queries and 326.9 on kv_qat ones at 64 rows on an H200)
FP4_QUERIES = {"qat": "iq_qat", "bf16": "iq"}
INDEX_KERNELS = ("index", "index_fp4", "index_reindex", "index_listed", "index_listed_fp4")
FP4_ENTRY = HEAD_DIM // 2 + HEAD_DIM // 16  # kv_qat's stored entry: e2m1 codes and e4m3 scales (288 B)


def layer_bytes(batch: int, ctx: int, pooled: int) -> dict:
    """Bytes each kernel must move at least, for `batch` rows of `ctx` entries (`pooled` of them
    indexed by a Reindex layer): index and attention as bench_kernels counts them; top-k one read
    of the scores and k values and indices out; dense every row's uncompressed KV read once (the
    roofline the targets compare with)."""
    return {
        "index": index_bytes(batch, ctx, ctx),
        "index_fp4": index_bytes(batch, ctx, ctx, fp4=True),
        "index_reindex": index_bytes(batch, ctx, pooled),
        # the listed pool: each id (4 B), its key and its score; the queries and head weights
        "index_listed": batch * (pooled * (INDEX_DIM * 2 + 8) + INDEX_HEADS * (INDEX_DIM * 2 + 4)),
        # the same over FP4 keys: 64 B of codes and 4 exponents per entry
        "index_listed_fp4": batch * (pooled * (INDEX_DIM // 2 + INDEX_DIM // 32 + 8)
                                     + INDEX_HEADS * (INDEX_DIM * 2 + 4)),
        "topk": batch * (4 * ctx + TOPK * 12),
        "topk_listed": batch * (4 * pooled + TOPK * 12),
        # the mask read, the ids written (once per step for every Reindex layer of the pool)
        "pool_list": batch * (ctx + 4 * pooled),
        "pool_list_torch": batch * (ctx + 4 * pooled),
        "attn": attn_bytes(batch),
        # kv_qat's FP4 entries: the selected rows' codes, scales and ids read, their bf16 rows written;
        # the attention over them then moves its own bytes with FP4 entries in place of bf16 ones
        "entries_fp4": batch * TOPK * (FP4_ENTRY + 8 + HEAD_DIM * 2),
        "attn_fp4": attn_bytes(batch) - batch * TOPK * (HEAD_DIM * 2 - FP4_ENTRY),
        "dense": batch * ctx * HEAD_DIM * 2,
    }


def layer_inputs(batch: int, ctx: int, gen: torch.Generator) -> dict:
    """Random bf16 inputs on the GPU (made there: at B = 64 and 128K the KV alone is 8.6 GB)."""
    def randn(*shape, dtype=BF16):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype)

    ik = randn(batch, ctx, INDEX_DIM)
    iq = randn(batch, 1, INDEX_HEADS, INDEX_DIM)
    # packed a row at a time: packing all 128 rows of 128K at once made a 16 GB temporary, over
    # what an 80 GB H100 had left beside the KV (session 30)
    packed = [fp4_pow2_pack(ik[b:b + 1]) for b in range(batch)]
    codes, exps = torch.cat([c for c, _ in packed]), torch.cat([e for _, e in packed])
    del packed
    blocks = ctx // CAND_BLOCK
    pool = torch.zeros(batch, blocks, dtype=torch.bool, device="cuda")
    picks = torch.rand(batch, blocks, generator=gen, device="cuda").argsort(dim=1)[:, :CAND_BLOCKS]
    pool.scatter_(1, picks, True)
    pool_mask = pool.repeat_interleave(CAND_BLOCK, dim=1).view(batch, 1, ctx)
    pooled = min(CAND_BLOCKS, blocks) * CAND_BLOCK
    return {
        "q": randn(batch, 1, HEADS, HEAD_DIM), "kv": randn(batch, ctx, HEAD_DIM),
        "win": randn(batch, WINDOW, HEAD_DIM),
        "wmask": torch.ones(batch, 1, WINDOW, dtype=torch.bool, device="cuda"),
        "sink": randn(HEADS, dtype=torch.float32), "iq": iq,
        "iw": randn(batch, 1, INDEX_HEADS, dtype=torch.float32), "ik": ik,
        # the FP4 layers' queries: the FP4 keys come with kv_qat, which rounds the index queries
        # too (model/attention.py); --fp4-queries bf16 gives them the bf16 ones instead
        "iq_qat": fp4_pow2_qat(iq), "codes": codes, "exps": exps,
        "all": torch.ones(batch, 1, ctx, dtype=torch.bool, device="cuda"),
        "pool": pool_mask, "list": csa2_ops.pool_entry_list(pool_mask, pooled),
        "idx": torch.randint(0, ctx, (batch, 1, TOPK), generator=gen, device="cuda"),
        # kv_qat's FP4 entries (any code byte is valid; scales 0.25 .. 0.94, as unit-normal entries get)
        "kv_codes": torch.randint(0, 256, (batch, ctx, HEAD_DIM // 2), generator=gen, device="cuda",
                                  dtype=torch.uint8),
        "kv_scales": torch.randint(40, 55, (batch, ctx, HEAD_DIM // 16), generator=gen, device="cuda",
                                   dtype=torch.uint8),
        "pooled": pooled,
    }


def select_listed(topk: StableTopkLauncher, x: dict, fp4: bool, fq: str, ctx: int) -> torch.Tensor:
    """A listed Reindex layer's selection from layer_inputs `x` as OpSet("triton").
    select_in_listed_pool runs it: the index over the listed pool (FP4 keys on the queries x[fq],
    or bf16 keys), then the top-k writing the picks' entry ids; with the launcher's INDEX_MAXIMA
    the index launch writes the scores' block maxima too, and the top-k takes them."""
    rows, p = x["list"].shape[0] * x["list"].shape[1], x["list"].shape[-1]
    block = topk.maxima_block(rows, p, TOPK)
    if fp4:
        args = (x[fq], x["iw"], x["codes"], x["exps"], x["list"])
        scored = (csa2_index_score_fp4_pooled_maxima(*args, block) if block
                  else csa2_index_score_fp4_pooled(*args))
    else:
        args = (x["iq"], x["iw"], x["ik"], x["list"])
        scored = csa2_index_score_pooled_maxima(*args, block) if block else csa2_index_score_pooled(*args)
    if block:
        return topk.listed_ids_with_maxima(scored[0], scored[1], x["list"], TOPK, ctx)
    return topk.listed_ids(scored, x["list"], TOPK, ctx)


def batch_case(batch: int, ctx: int, gen: torch.Generator, bw: float, cold: bool,
               topk_over: dict | None = None, fp4_queries: str = "qat",
               attn_over: dict | None = None) -> dict:
    x = layer_inputs(batch, ctx, gen)
    fq = FP4_QUERIES[fp4_queries]
    attn = attn_kernel.SparseAttentionLauncher(overrides=attn_over or {})
    topk = StableTopkLauncher(overrides=topk_over or {})
    scale = HEAD_DIM ** -0.5

    def index(kind):
        if kind == "reindex_listed":
            return csa2_index_score_pooled(x["iq"], x["iw"], x["ik"], x["list"])
        if kind == "reindex_listed_fp4":
            return csa2_index_score_fp4_pooled(x[fq], x["iw"], x["codes"], x["exps"], x["list"])
        if kind == "full_fp4":
            return index_kernel.csa2_index_score_fp4(x[fq], x["iw"], x["codes"], x["exps"], x["all"])
        visible = x["pool" if kind == "reindex" else "all"]
        return index_kernel.csa2_index_score(x["iq"], x["iw"], x["ik"], visible)

    def select(kind):
        if kind in ("reindex_listed", "reindex_listed_fp4"):
            return select_listed(topk, x, kind == "reindex_listed_fp4", fq, ctx)
        return topk(index(kind), TOPK)[1]

    def layer(kind):
        sel = x["idx"] if kind == "reuse" else select(kind)
        return attn(x["q"], x["kv"], sel, x["win"], x["wmask"], x["sink"], scale)

    nbytes = layer_bytes(batch, ctx, x["pooled"])
    out = {"bytes": nbytes, "layer_us": {}, "kernel_us": {}}
    for kind in LAYERS:
        out["layer_us"][kind] = 1e3 * time_ms(lambda kind=kind: layer(kind), graph=True)
        if cold:
            out.setdefault("layer_cold_us", {})[kind] = 1e3 * time_cold_ms(lambda kind=kind: layer(kind))
    scores = index("full")
    out["topk_exact"] = torch.equal(topk(scores, TOPK)[1], stable_topk_reference(scores, TOPK)[1])
    if not out["topk_exact"]:
        log.warning("top-k kernel differs from the stable sort (batch %d, %d entries)", batch, ctx)
    # both Reindex forms rank the same pooled entries: the same picks, unless the two kernels'
    # scores differ in a last bit at the k-th place
    want = select_topk(index("reindex"), TOPK, topk=topk)
    out["listed_same_selection"] = torch.equal(select("reindex_listed"), want)
    if not out["listed_same_selection"]:
        log.warning("the listed Reindex picks differ from the mask form's (batch %d, %d entries)", batch, ctx)
    fp4_pool_scores = index_kernel.csa2_index_score_fp4(x[fq], x["iw"], x["codes"], x["exps"], x["pool"])
    want_fp4 = select_topk(fp4_pool_scores, TOPK, topk=topk)
    out["listed_fp4_same_selection"] = torch.equal(select("reindex_listed_fp4"), want_fp4)
    if not out["listed_fp4_same_selection"]:
        log.warning("the listed FP4 Reindex picks differ from the FP4 mask form's (batch %d)", batch)
    k = out["kernel_us"]
    for kind, name in zip(LAYERS[:-1], INDEX_KERNELS):  # every layer but Reuse has an index kernel
        k[name] = 1e3 * time_ms(lambda kind=kind: index(kind), graph=True)
    k["topk"] = 1e3 * time_ms(lambda: topk(scores, TOPK), graph=True)
    listed = index("reindex_listed")
    k["topk_listed"] = 1e3 * time_ms(lambda: topk(listed, TOPK), graph=True)
    # listing the pool: once per step for all the Reindex layers of a pool; the kernel, and the
    # PyTorch ops it replaced (cumsum, where, scatter)
    out["pool_list_exact"] = torch.equal(pool_entry_list(x["pool"], x["pooled"]), x["list"])
    k["pool_list"] = 1e3 * time_ms(lambda: pool_entry_list(x["pool"], x["pooled"]), graph=True)
    k["pool_list_torch"] = 1e3 * time_ms(lambda: csa2_ops.pool_entry_list(x["pool"], x["pooled"]), graph=True)
    k["attn"] = 1e3 * time_ms(lambda: attn(x["q"], x["kv"], x["idx"], x["win"], x["wmask"], x["sink"], scale),
                              graph=True)
    fp4_kv = (x["kv_codes"], x["kv_scales"])
    k["entries_fp4"] = 1e3 * time_ms(lambda: csa2_entries_fp4(x["q"], *fp4_kv, x["idx"]), graph=True)
    rows = torch.arange(TOPK, device="cuda").view(1, 1, TOPK).expand(batch, 1, TOPK)

    def attn_fp4():  # OpSet.csa2_sparse_attention_fp4: the selected rows decoded, then the attention
        kv = csa2_entries_fp4(x["q"], *fp4_kv, x["idx"])
        return attn(x["q"], kv, rows, x["win"], x["wmask"], x["sink"], scale)

    k["attn_fp4"] = 1e3 * time_ms(attn_fp4, graph=True)
    dense_us = nbytes["dense"] / bw / 1e3
    out["dense_roofline_us"] = dense_us
    out["x_dense"] = {kind: dense_us / us for kind, us in out["layer_us"].items()}
    out["roofline_fraction"] = {name: nbytes[name] / bw / 1e3 / us for name, us in k.items()}
    return out


def topk_settings(chunks: list[int], digits: list[tuple], blocks: list[int] = (), ranks: list[int] = (),
                  firsts: list[int] = (), ties: bool = False, custom: list[dict] = ()) -> dict:
    """Label -> StableTopkLauncher overrides: each chunk with 4 warps, 4 warps without the idle
    skip and 8 warps; each digit split (widths of the passes, most significant first) with the
    launcher's own chunk; with `blocks`, the radix form and the block-max form (prefilter.py) at
    each block size; with `ranks`, the block-max form's collect launch reading whole chunks against
    reading the live blocks only, then the live collect under each rank block (candidates per rank
    program); with `firsts`, the block-max form's first launch at each count of blocks per program
    (BM_CHUNK: 16 blocks of 16 scores are 1 KB per program); with `ties`, its rank launch with the
    entries tied at T written by programs of their own against by the rank programs; with `custom`
    (--topk-sweep), the launcher's defaults and then each set of overrides, labelled by its text."""
    out = {"radix form": {"FORM": "radix"}} if blocks else {}
    if custom:
        out["defaults"] = {}
    for over in custom:
        out[",".join(f"{k}={v}" for k, v in over.items())] = over
    if ranks:
        out["collect chunk"] = {"COLLECT": "chunk"}
        out["collect live"] = {"COLLECT": "live"}
    for rank in ranks:
        out[f"collect live, rank block {rank}"] = {"COLLECT": "live", "RANK_BLOCK": rank}
    for block in blocks:
        out[f"block-max form, blocks of {block}"] = {"FORM": "prefilter", "BLOCK": block}
    for first in firsts:
        out[f"first launch, {first} blocks per program"] = {"FORM": "prefilter", "BM_CHUNK": first}
    if ties:
        out["ties in programs of their own"] = {"FORM": "prefilter", "TIES": "chunk"}
        out["ties in the rank programs"] = {"FORM": "prefilter", "TIES": "rank"}
    for chunk in chunks:
        for warps, skip in ((4, True), (4, False), (8, True)):
            out[f"chunk {chunk} warps {warps}{'' if skip else ' no skip'}"] = {
                "CHUNK": chunk, "num_warps": warps, "SKIP_IDLE": skip}
    for split in digits:
        out["digits " + "-".join(map(str, split))] = {"DIGITS": split}
    return out


def parse_overrides(text: str, known: frozenset = StableTopkLauncher.OVERRIDES, option: str = "--topk-over",
                    what: str = "top-k") -> dict:
    """'KEY=VALUE,...' of a launcher-override option (--topk-over here; attention_ablation.py's
    --attn-over) as a dict (digit strings as ints, True / False as booleans), or a ValueError
    naming the entry; KEY must be one the launcher reads (`known`: an unknown one would be
    ignored, and the table would claim a setting it did not run)."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise ValueError(f"{option}: {item!r} is not KEY=VALUE")
        if key not in known:
            raise ValueError(f"{option}: {key!r} is not a {what} override (one of {sorted(known)})")
        out[key] = int(value) if value.isdigit() else {"True": True, "False": False}.get(value, value)
    return out


def topk_sweep(batch: int, ctx: int, gen: torch.Generator, settings: dict,
               kinds: tuple = ("full", "reindex", "listed"), base: dict | None = None) -> dict:
    """The top-k's launch settings at a batch (topk_settings, each over the overrides `base`), on
    the index kernel's scores of a Full and of a Reindex layer (mask form: all entries; list form:
    the pool's), those of `kinds`: at B rows a digit pass launches B x ctx / CHUNK programs, each
    building a 2^bits-bin histogram. The listed pool's top-k runs as the model's eager step runs
    it (listed_ids: entry ids from the rank launch). Every setting is checked bit for bit against
    the stable sort first (the listed form: against csa2_ops.select_listed_topk; NaN: it
    differed)."""
    x = layer_inputs(batch, ctx, gen)
    scores = {kind: index_kernel.csa2_index_score(x["iq"], x["iw"], x["ik"], x[vis])
              for kind, vis in (("full", "all"), ("reindex", "pool")) if kind in kinds}
    if "listed" in kinds:
        scores["listed"] = csa2_index_score_pooled(x["iq"], x["iw"], x["ik"], x["list"])
    entries = x["list"]
    del x
    out = {}
    for kind, s in scores.items():
        if kind == "listed":
            want = csa2_ops.select_listed_topk(s, entries, TOPK, ctx)
        else:
            want = stable_topk_reference(s, TOPK)[1]
        for name, over in settings.items():
            topk = StableTopkLauncher(overrides=(base or {}) | over)

            def run(topk=topk, s=s, kind=kind):
                return topk.listed_ids(s, entries, TOPK, ctx) if kind == "listed" else topk(s, TOPK)[1]

            label = f"{kind} {name}"
            if not torch.equal(run(), want):
                log.warning("top-k with %s differs from the stable sort (batch %d)", label, batch)
                out[label] = float("nan")
                continue
            out[label] = 1e3 * time_ms(run, graph=True)
    return out


def fp4_sweep(batch: int, ctx: int, gen: torch.Generator, configs: list[dict],
              fp4_queries: str = "qat") -> dict:
    """The FP4 index kernel's FP8 tensor-core path (fp4_mma.py) under each launch config, over
    every entry of B rows. Each config's scores are compared with the launch default's first:
    the same per-entry products in another tiling should give the same bits ('max_rel_diff' in
    the JSON, a warning when not 0)."""
    x = layer_inputs(batch, ctx, gen)
    fq = FP4_QUERIES[fp4_queries]
    args = (x[fq], x["iw"], x["codes"], x["exps"], x["all"])
    def scores(over):
        return index_kernel.csa2_index_score_fp4(*args, overrides=over)

    want = scores({"PATH": "mma"})
    scale = want.abs().max().item()
    out = {}
    for cfg in configs:
        over = {"PATH": "mma"} | cfg
        label = " ".join(f"{k} {v}" for k, v in cfg.items() if k != "PATH") or cfg["PATH"]
        diff = (scores(over) - want).abs().nan_to_num(0.0).max().item()
        if diff:
            log.warning("FP4 index with %s differs from the default launch by %.3g of the largest score",
                        label, diff / scale)
        us = 1e3 * time_ms(lambda over=over: scores(over), graph=True)
        out[label] = {"us": us, "max_rel_diff": diff / scale}
    # the listed pool's FP4 kernel (pooled_fp4.py: the same products, ids from the list) under the
    # same settings, against its own launch default
    listed_args = (x[fq], x["iw"], x["codes"], x["exps"], x["list"])
    want = csa2_index_score_fp4_pooled(*listed_args)
    for cfg in configs:
        if cfg.get("PATH") == "decode":
            continue
        label = "listed " + (" ".join(f"{k} {v}" for k, v in cfg.items()) or "default")
        got = csa2_index_score_fp4_pooled(*listed_args, overrides=cfg)
        diff = (got - want).abs().nan_to_num(0.0).max().item()
        if diff:
            log.warning("listed FP4 index with %s differs from its default launch by %.3g", label,
                        diff / scale)
        us = 1e3 * time_ms(lambda cfg=cfg: csa2_index_score_fp4_pooled(*listed_args, overrides=cfg),
                           graph=True)
        out[label] = {"us": us, "max_rel_diff": diff / scale}
    return out


# the FP4 sweep's flags: the exponents a byte per load; the lo products skipped on rows without a
# lo part, or not (fp4_mma.py, pooled_fp4.py: LO_SKIP)
FP4_FLAGS = {"b": {"EXP_WORDS": False}, "s": {"LO_SKIP": True}, "n": {"LO_SKIP": False}}


def parse_fp4_configs(text: str) -> list[dict]:
    """'BLOCK_N:BLOCKS:num_warps:STAGES[:b][:s|:n][:rREGS]' entries, comma-separated (b: one exponent
    byte per load instead of the 32-bit words; s / n: LO_SKIP on / off in both kernels, the lo
    products skipped on rows without a lo part (the defaults: off in the mask kernel, on in the
    listed one); rREGS: ptxas's register cap per thread, maxnreg, r0 none: the listed kernel's
    default is 128), or 'decode' (the decode path, for comparison)."""
    configs = []
    for item in filter(None, text.split(",")):
        if item == "decode":  # the exact decode to bf16 keys (kernel.py), for comparison
            configs.append({"PATH": "decode"})
            continue
        parts = item.split(":")
        flags = parts[4:]
        numbers_ok = len(parts) >= 4 and all(p.isdigit() for p in parts[:4])
        known = all(f in FP4_FLAGS or (f[:1] == "r" and f[1:].isdigit()) for f in flags)
        if not numbers_ok or not known or {"s", "n"} <= set(flags):
            raise ValueError(f"FP4 config {item!r} is not BLOCK_N:BLOCKS:num_warps:STAGES[:b][:s|:n][:rREGS]")
        block_n, blocks, warps, stages = map(int, parts[:4])
        cfg = {"BLOCK_N": block_n, "BLOCKS": blocks, "num_warps": warps, "STAGES": stages}
        for flag in flags:
            cfg |= FP4_FLAGS.get(flag) or {"maxnreg": int(flag[1:]) or None}
        configs.append(cfg)
    return configs


def attn_sweep(batch: int, ctx: int, gen: torch.Generator, configs: list[dict]) -> dict:
    """The sparse attention's launch settings at a batch (Reuse's selection: K = 512 picks and the
    128-key window per row). Each setting's output is compared with the launch default's first
    ('max_abs_diff' in the JSON, a warning above 1e-2: the same softmax in another tiling differs
    in rounding only). A setting whose kernel needs more shared memory than the GPU has is a
    result (NaN and the error in the JSON), not the end of the sweep."""
    x = layer_inputs(batch, ctx, gen)
    args = (x["q"], x["kv"], x["idx"], x["win"], x["wmask"], x["sink"], HEAD_DIM ** -0.5)
    default = attn_kernel.SparseAttentionLauncher()
    want = default(*args)
    out = {"launcher default": {"us": 1e3 * time_ms(lambda: default(*args), graph=True), "max_abs_diff": 0.0}}
    for cfg in configs:
        n_split = cfg.get("n_split")
        over = {k: v for k, v in cfg.items() if k != "n_split"}
        attn = attn_kernel.SparseAttentionLauncher(overrides=over)
        label = " ".join(f"{k} {v}" for k, v in cfg.items())
        try:
            diff = (attn(*args, n_split=n_split).float() - want.float()).abs().max().item()
        except OutOfResources as err:  # e.g. 64-key blocks in 3 stages: 256 KB of shared memory
            log.warning("attention with %s does not fit: %s", label, err)
            out[label] = {"us": float("nan"), "error": str(err)}
            continue
        if not diff <= 1e-2:
            log.warning("attention with %s differs from the default launch by %.3g", label, diff)
        us = 1e3 * time_ms(lambda attn=attn, n_split=n_split: attn(*args, n_split=n_split), graph=True)
        out[label] = {"us": us, "max_abs_diff": diff}
    return out


def parse_attn_configs(text: str) -> list[dict]:
    """'BLOCK_H:BLOCK_K:num_warps:num_stages[:SPLITS][:a][:pN]' entries, comma-separated (SPLITS:
    key splits per row instead of the launcher's plan; a: INDEX_AHEAD, the selected entries' ids
    loaded a loop step ahead; pN: PREFETCH N, key blocks hinted into L2 ahead)."""
    form = "BLOCK_H:BLOCK_K:num_warps:num_stages[:SPLITS][:a][:pN]"
    configs = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        head, tail = parts[:4], parts[4:]
        if len(head) != 4 or not all(p.isdigit() and int(p) > 0 for p in head):
            raise ValueError(f"attention config {item!r} is not {form}")
        bh, bk, warps, stages = map(int, head)
        cfg = {"BLOCK_H": bh, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
        if tail and tail[0].isdigit() and int(tail[0]) > 0:
            cfg["n_split"] = int(tail.pop(0))
        for flag in tail:
            if flag == "a" and "INDEX_AHEAD" not in cfg:
                cfg["INDEX_AHEAD"] = True
            elif flag[:1] == "p" and prefetch_distance(flag[1:]) and "PREFETCH" not in cfg:
                cfg["PREFETCH"] = int(flag[1:])
            else:
                raise ValueError(f"attention config {item!r} is not {form}")
        configs.append(cfg)
    return configs


def prefetch_distance(text: str) -> bool:
    """Whether `text` is a PREFETCH the kernel takes besides 0: a power of two (one load of that
    many blocks' ids)."""
    return text.isdigit() and is_pow2(int(text))


def with_prefetch(configs: list[dict], text: str) -> list[dict]:
    """Each attention config (the launcher default when none) at each prefetch distance of the
    comma-separated `text` (PREFETCH, key blocks ahead); the configs unchanged when it is empty."""
    if not text:
        return configs
    ahead = text.split(",")
    if not all(a == "0" or prefetch_distance(a) for a in ahead):
        raise ValueError(f"--attn-prefetch {text!r} is not comma-separated ints, each 0 or a power of two")
    return [cfg | {"PREFETCH": int(a)} for cfg in configs or [{}] for a in ahead]


def report(res: dict) -> str:
    head = (f"{res['gpu']}  torch {res['torch']}  triton {res['triton']}  {res['date']}  "
            f"copy {res['bw_GBps']:.0f} GB/s")
    if res.get("topk_overrides"):
        head += f"  top-k overrides {res['topk_overrides']}"
    if res.get("attn_overrides"):
        head += f"  attention overrides {res['attn_overrides']}"
    head += f"  FP4 layers' index queries: {res.get('fp4_queries', 'bf16')}"
    columns = ("| batch | context | dense roofline | Full (bf16 keys) | Full (FP4 keys) | Reindex (mask) | "
               "Reindex (list) | Reindex (list, FP4 keys) | Reuse | index / FP4 / pool mask / pool list / "
               "pool list FP4 | top-k / list | attention | FP4 entries: decode / + attention | "
               "listing the pool (per step) |")
    lines = [head, columns, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case in res["cases"]:
        lay, x, f, ku = case["layer_us"], case["x_dense"], case["roofline_fraction"], case["kernel_us"]
        cells = [f"{lay[kind]:.1f} us ({x[kind]:.1f}x{'' if x[kind] >= TARGETS[kind] else ' <'})"
                 for kind in LAYERS]
        kern = [f"{ku[n]:.1f} us ({100 * f[n]:.0f}%)" for n in INDEX_KERNELS]
        topks = [f"{ku[n]:.1f} us ({100 * f[n]:.0f}%)" for n in ("topk", "topk_listed")]
        lines.append(f"| {case['batch']} | {case['context']} | {case['dense_roofline_us']:.1f} us | "
                     + " | ".join(cells) + f" | {' / '.join(kern)} | {' / '.join(topks)} | "
                     f"{ku['attn']:.1f} us ({100 * f['attn']:.0f}%) | {ku['entries_fp4']:.1f} us "
                     f"({100 * f['entries_fp4']:.0f}%) / {ku['attn_fp4']:.1f} us ({100 * f['attn_fp4']:.0f}%) | "
                     f"{ku['pool_list']:.1f} us "
                     f"(PyTorch {ku['pool_list_torch']:.1f}) |")
    lines.append("(x: the dense roofline over the layer's time; '<' marks a layer under issue 5's target; "
                 "%: counted bytes / copy bandwidth / time)")
    return "\n".join(lines)


KERNEL_LABELS = {"index": "index, bf16 keys", "index_fp4": "index, FP4 keys", "index_listed_fp4":
                 "index, listed pool, FP4 keys", "topk": "top-k", "attn": "sparse attention"}
LAYER_LABELS = {"full": "Full, bf16 index keys", "full_fp4": "Full, FP4 index keys", "reindex": "Reindex (mask)",
                "reindex_listed_fp4": "Reindex (list, FP4 keys)", "reuse": "Reuse"}


def plot(res: dict, path: Path) -> None:
    """The layer table as a figure, per context: each layer's speed-up over the dense roofline against
    the rows (issue 5's targets dashed: 3x Full, 15x Reindex / Reuse), and each kernel's fraction of
    its own roofline (the 70% target dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({case["context"] for case in res["cases"]})
    fig, axes = plt.subplots(len(contexts), 2, figsize=(12, 4.5 * len(contexts)), squeeze=False)
    for (speed, frac), ctx in zip(axes, contexts):
        cases = sorted((c for c in res["cases"] if c["context"] == ctx), key=lambda c: c["batch"])
        rows = [c["batch"] for c in cases]
        for kind, label in LAYER_LABELS.items():
            speed.plot(rows, [c["x_dense"][kind] for c in cases], "o-", label=label)
        for target in sorted(set(TARGETS.values())):
            speed.axhline(target, color="k", ls="--", lw=0.8)
        speed.set_yscale("log")
        speed.set_yticks([1, 3, 10, 15, 30], ["1", "3", "10", "15", "30"])
        speed.set(xscale="log", xlabel="decode rows", ylabel="x the dense roofline",
                  title=f"CSA2 layers at {ctx // 1024}K entries per row (targets: 3x, 15x)")
        for name, label in KERNEL_LABELS.items():
            frac.plot(rows, [100 * c["roofline_fraction"][name] for c in cases], "o-", label=label)
        frac.axhline(70, color="k", ls="--", lw=0.8)
        frac.set(xscale="log", xlabel="decode rows", ylabel="% of its roofline",
                 title="each kernel against its counted bytes (target: 70%)")
        for ax in (speed, frac):
            ax.set_xticks(rows, [str(r) for r in rows])
            ax.legend(fontsize=8)
    fig.suptitle(f"{res['gpu']}, {res['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--cold", action="store_true", help="also time one replay after a 256 MB read")
    ap.add_argument("--topk-chunks", default="", help="sweep the top-k's CHUNK (e.g. 512,1024,2048) "
                    "at each batch and context instead of timing the layers")
    ap.add_argument("--topk-digits", default="",
                    help="sweep the top-k's digit splits (e.g. 8-8-8-8,4-4-8-8-8)")
    ap.add_argument("--topk-blocks", default="",
                    help="sweep the top-k's radix form against its block-max form at these block sizes "
                    "(e.g. 8,16)")
    ap.add_argument("--topk-ranks", default="",
                    help="sweep the block-max form's collect launch (whole chunks, live blocks) and its "
                    "rank block (candidates per rank program, e.g. 4,16,64)")
    ap.add_argument("--topk-first", default="",
                    help="sweep the block-max form's first launch: blocks per program (powers of two, "
                    "e.g. 32,128,512)")
    ap.add_argument("--topk-ties", action="store_true",
                    help="sweep the block-max form's rank launch: the ties at T in programs of their own "
                    "or in the rank programs")
    ap.add_argument("--topk-sweep", default="",
                    help="sweep the top-k over the launcher's defaults and these sets of overrides, "
                    "';'-separated, each as --topk-over (e.g. 'PASS_LAUNCH=each;RANK_COVER=1,PASS_WARPS=4'); "
                    "all sweeps run over --topk-over's")
    ap.add_argument("--topk-kinds", default="full,reindex,listed",
                    help="the scores the top-k sweeps run on (full, reindex: every entry of 'ctx'; listed: "
                    "a Reindex layer's listed pool)")
    ap.add_argument("--topk-over", default="",
                    help="time the layers with these top-k launcher overrides (KEY=VALUE,..., "
                    "e.g. COLLECT=chunk; integers as integers)")
    ap.add_argument("--attn-over", default="",
                    help="time the layers with these sparse-attention launcher overrides (KEY=VALUE,..., "
                    "e.g. PDL=True: the Gluon launch with programmatic dependent launch, off by default)")
    ap.add_argument("--fp4-configs", default="", help="sweep the FP4 index kernel's launch "
                    "(BLOCK_N:BLOCKS:num_warps:STAGES[:b][:s|:n][:rREGS],...) instead of timing the layers")
    ap.add_argument("--fp4-queries", choices=sorted(FP4_QUERIES), default="qat",
                    help="the FP4 layers' index queries: kv_qat's FP4 rounding, as the model makes them "
                    "(default), or bf16 ones (sessions 19-35's runs)")
    ap.add_argument("--attn-configs", default="", help="sweep the sparse attention's launch "
                    "(BLOCK_H:BLOCK_K:num_warps:num_stages[:SPLITS][:a][:pN],...) instead of timing the "
                    "layers")
    ap.add_argument("--attn-prefetch", default="", help="sweep the sparse attention's L2 prefetch distance "
                    "(key blocks ahead: 0 or powers of two, comma-separated) over the launcher default and "
                    "each --attn-configs entry")
    ap.add_argument("--plot-from", default="", help="only draw the figure of a saved bench_layer_batch.json "
                    "into --out (no GPU needed)")
    args = ap.parse_args()
    if args.plot_from:
        saved = Path(args.plot_from)
        if not saved.is_file():
            ap.error(f"--plot-from: no file {saved}")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        plot(json.loads(saved.read_text()), out / (saved.stem + ".png"))
        return
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    bad = [v for v in batches + contexts if v < 1] + [c for c in contexts if c % CAND_BLOCK]
    if bad:
        ap.error(f"batches and contexts must be >= 1 and contexts multiples of {CAND_BLOCK}; got {bad}")
    try:
        fp4_configs = parse_fp4_configs(args.fp4_configs)
        attn_configs = with_prefetch(parse_attn_configs(args.attn_configs), args.attn_prefetch)
        digits = [tuple(int(d) for d in split.split("-"))
                  for split in filter(None, args.topk_digits.split(","))]
        for split in digits:
            digit_passes(split)  # widths 1..11 adding up to 32, or a ValueError naming them
        topk_over = parse_overrides(args.topk_over)
        attn_over = parse_overrides(args.attn_over, attn_kernel.SparseAttentionLauncher.OVERRIDES,
                                    "--attn-over", "sparse-attention")
        topk_custom = [parse_overrides(item, option="--topk-sweep")
                       for item in filter(None, args.topk_sweep.split(";"))]
        topk_kinds = tuple(filter(None, args.topk_kinds.split(",")))
        if not topk_kinds or set(topk_kinds) - {"full", "reindex", "listed"}:
            raise ValueError(f"--topk-kinds: {args.topk_kinds!r} is not a list of full, reindex, listed")
    except ValueError as err:
        ap.error(str(err))
    if not torch.cuda.is_available():
        ap.error("the layer benchmark times CUDA graphs: it needs a GPU")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = ceilings(quick=True)["copy_GBps"]
    res = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "torch": torch.__version__, "triton": triton.__version__, "bw_GBps": bw,
           "topk_overrides": topk_over, "attn_overrides": attn_over, "fp4_queries": args.fp4_queries,
           "cases": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    topk_blocks = [int(b) for b in filter(None, args.topk_blocks.split(","))]
    topk_ranks = [int(r) for r in filter(None, args.topk_ranks.split(","))]
    topk_firsts = [int(f) for f in filter(None, args.topk_first.split(","))]
    topk_sweeps = (args.topk_chunks or digits or topk_blocks or topk_ranks or topk_firsts or args.topk_ties
                   or topk_custom)
    if topk_sweeps:
        chunks = [int(c) for c in filter(None, args.topk_chunks.split(","))]
        settings = topk_settings(chunks, digits, topk_blocks, topk_ranks, topk_firsts, args.topk_ties,
                                 topk_custom)
        res["topk_sweep_us"] = {f"batch {b} ctx {c}": topk_sweep(b, c, gen, settings, topk_kinds, topk_over)
                                for c in contexts for b in batches}
        (out / "topk_sweep.json").write_text(json.dumps(res, indent=1))
        for case, times in res["topk_sweep_us"].items():
            log.info("%s: %s", case, ", ".join(f"{k} {us:.1f} us" for k, us in times.items()))
    if fp4_configs:
        res["fp4_sweep"] = {}
        for c in contexts:
            for b in batches:
                case = res["fp4_sweep"][f"batch {b} ctx {c}"] = fp4_sweep(b, c, gen, fp4_configs,
                                                                          args.fp4_queries)
                pooled = min(CAND_BLOCKS, c // CAND_BLOCK) * CAND_BLOCK
                roof = {"mask": index_bytes(b, c, c, fp4=True) / bw / 1e3,
                        "listed": layer_bytes(b, c, pooled)["index_listed_fp4"] / bw / 1e3}
                (out / "fp4_sweep.json").write_text(json.dumps(res, indent=1))
                times = (f"{k} {v['us']:.1f} us "
                         f"({100 * roof['listed' if k.startswith('listed') else 'mask'] / v['us']:.0f}%)"
                         for k, v in case.items())
                log.info("batch %d ctx %d (rooflines %.1f / %.1f us): %s", b, c, roof["mask"], roof["listed"],
                         ", ".join(times))
    if attn_configs:
        res["attn_sweep"] = {}
        for c in contexts:
            for b in batches:
                case = res["attn_sweep"][f"batch {b} ctx {c}"] = attn_sweep(b, c, gen, attn_configs)
                roof = attn_bytes(b) / bw / 1e3
                (out / "attn_sweep.json").write_text(json.dumps(res, indent=1))
                times = (f"{k}: {v['us']:.1f} us ({100 * roof / v['us']:.0f}%)" for k, v in case.items())
                log.info("batch %d ctx %d (roofline %.1f us): %s", b, c, roof, ", ".join(times))
    if topk_sweeps or fp4_configs or attn_configs:
        return
    for ctx in contexts:
        for batch in tqdm(batches, desc=f"layers at {ctx}"):
            res["cases"].append({"batch": batch, "context": ctx}
                                | batch_case(batch, ctx, gen, bw, args.cold, topk_over, args.fp4_queries,
                                             attn_over))
            torch.cuda.empty_cache()
            (out / "bench_layer_batch.json").write_text(json.dumps(res, indent=1))
    log.info("\n%s", report(res))
    plot(res, out / "bench_layer_batch.png")


if __name__ == "__main__":
    main()
