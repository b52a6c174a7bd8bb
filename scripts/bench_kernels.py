#!/usr/bin/env python3
"""Microbenchmarks of the plugin kernels on a GPU (PIPELINE.md §8): each kernel against its
PyTorch reference run eagerly and against its roofline from counted bytes, with in-run ceilings
(device copy bandwidth, random-row gather bandwidth). Prints a table, writes JSON and a plot.

    python scripts/bench_kernels.py --out bench_out [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from pathlib import Path

import torch
import triton
import triton.testing
from tqdm import tqdm

from dsflash.model.csa2_ops import select_listed_topk
from dsflash.model.quant import fp4_pow2_pack
from dsflash.plugins.csa2_index_score import kernel as index_kernel
from dsflash.plugins.csa2_index_score import reference as index_ref
from dsflash.plugins.csa2_index_score.pool_list import listed_picks, pool_entry_list
from dsflash.plugins.csa2_index_score.pooled import csa2_index_score_pooled
from dsflash.plugins.csa2_sparse_attention import kernel as attn_kernel
from dsflash.plugins.csa2_sparse_attention import reference as attn_ref
from dsflash.plugins.engram_hash_gather import kernel as engram_kernel
from dsflash.plugins.engram_hash_gather import reference as engram_ref
from dsflash.plugins.mhc_boundary import kernel as mhc_kernel
from dsflash.plugins.mhc_boundary import reference as mhc_ref
from dsflash.plugins.stable_topk.kernel import StableTopkLauncher
from dsflash.plugins.stable_topk.reference import stable_topk as stable_topk_reference

log = logging.getLogger("bench_kernels")

BF16 = torch.bfloat16
# the released sizes (model/config.py defaults)
HEADS, HEAD_DIM, TOPK, WINDOW = 64, 512, 512, 128
INDEX_HEADS, INDEX_DIM, CAND_BLOCKS, CAND_BLOCK = 32, 128, 2048, 8
HIDDEN, HC = 5120, 4
ENGRAM_LOOK, ENGRAM_HEADS, ENGRAM_DIM = 3, 8, 256


def time_ms(fn, graph: bool = False) -> float:
    """Median milliseconds; small launches are timed as CUDA-graph replays (no launch gaps)."""
    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_cold_ms(fn, reps: int = 50, cold: bool = True) -> float:
    """Median milliseconds of fn captured once as a CUDA graph and replayed after a 256 MB read has
    replaced the L2 cache's contents: what a decode layer sees when the layers before it have
    evicted its caches. do_bench_cudagraph replays fn back to back instead, so a working set under
    the H200's 50 MB L2 (the index keys up to 128K entries, 32 MB) is read from L2 there. The flush
    reads rather than writes (triton's do_bench zero-fills a buffer): a write leaves up to 50 MB
    of dirty lines that the timed kernels then pay to write back (H200, 2026-12-03: the index
    kernel at 128K took 19.1 us after do_bench's zero-fill against 9.3 us warm).

    One replay timed alone between two events also pays what back-to-back replays hide (the
    graph's start after the event): time_cold_ms(fn, cold=False) times the same single replay
    after the GPU has spun ~100 us on nothing instead (fn's data stays in L2; the host has queued
    the replay by then, as it has behind the flush), so the difference of the two is what reading
    from HBM costs. (A 1 MB read before it was too short: the replay's host launch showed.)"""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.ones(64 << 20, dtype=torch.float32, device="cuda")  # 256 MB
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        if cold:
            flush.sum()  # the GPU reads 256 MB while the host queues the replay: no launch gap
        else:
            torch.cuda._sleep(200_000)  # ~100 us of spinning, nothing read
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def ceilings(quick: bool) -> dict:
    n = (1 << 28) if quick else (1 << 30)  # bytes
    src = torch.randn(n // 2, device="cuda", dtype=BF16)
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src))

    rows = 8 << 20
    table = torch.randn(rows, ENGRAM_DIM, device="cuda", dtype=BF16)
    idx = torch.randint(0, rows, (8192 * ENGRAM_LOOK * ENGRAM_HEADS,), device="cuda")
    gather_ms = time_ms(lambda: torch.index_select(table, 0, idx))
    return {"copy_GBps": 2 * n / copy_ms / 1e6,
            "gather_GBps": idx.numel() * ENGRAM_DIM * 2 / gather_ms / 1e6}


def engram_case(batch: int, new: int, table, gen) -> dict:
    cols = ENGRAM_LOOK * ENGRAM_HEADS
    per = table.shape[0] // cols - 64
    primes = [per + 2 * i for i in range(cols)]  # sizes only matter for the access pattern
    offsets = [sum(primes[:i]) for i in range(cols)]
    mult = [int(m) * 2 + 1 for m in torch.randint(1, 2**30, (ENGRAM_LOOK + 1,), generator=gen)]
    cids = torch.randint(0, 16384, (batch, ENGRAM_LOOK + new), generator=gen).to("cuda")
    args = (cids, table, mult, primes, offsets, 3, ENGRAM_HEADS)
    small = batch * new <= 256
    k_ms = time_ms(lambda: engram_kernel.engram_hash_gather(*args), graph=small and table.is_cuda)
    r_ms = time_ms(lambda: engram_ref.engram_hash_gather(*args)) if table.is_cuda else float("nan")
    gathered = batch * new * cols * ENGRAM_DIM * 2
    return {"kernel_us": 1e3 * k_ms, "eager_us": 1e3 * r_ms, "gathered_GBps": gathered / k_ms / 1e6}


def index_bytes(rows: int, ctx: int, keys: int, fp4: bool = False) -> int:
    """What the index kernel must move for `rows` query rows over `ctx` entries of which `keys` are
    visible: their keys (bf16, or the release's FP4 codes and exponents: 68 B at 128 dims), one
    mask byte and one fp32 score per entry, the queries and head weights."""
    key = INDEX_DIM // 2 + INDEX_DIM // 32 if fp4 else INDEX_DIM * 2
    return rows * (keys * key + ctx + 4 * ctx + INDEX_HEADS * (INDEX_DIM * 2 + 4))


def attn_bytes(rows: int) -> int:
    """What sparse attention must move per decode: the selected and window rows with their index
    or mask, the query and the output, for `rows` query rows."""
    return rows * ((TOPK + WINDOW) * (HEAD_DIM * 2 + 8) + 2 * HEADS * HEAD_DIM * 2)


def csa2_layer(kind: str, ctx: int, gen) -> dict:
    """One decode row of a CSA2 layer at context ctx: Full (ratio 1, index every entry), Reindex
    (index the candidate pool of 2048 blocks x 8 only: listed, as OpSet("triton") runs it since
    session 20, and as a mask, `layer_mask_us`), Reuse (another layer's selection)."""
    n = ctx
    q = torch.randn(1, 1, HEADS, HEAD_DIM, generator=gen).to("cuda", BF16)
    kv = torch.randn(1, n, HEAD_DIM, generator=gen).to("cuda", BF16)
    win = torch.randn(1, WINDOW, HEAD_DIM, generator=gen).to("cuda", BF16)
    wmask = torch.ones(1, 1, WINDOW, dtype=torch.bool, device="cuda")
    sink = torch.randn(HEADS, generator=gen).cuda()
    iq = torch.randn(1, 1, INDEX_HEADS, INDEX_DIM, generator=gen).to("cuda", BF16)
    iw = torch.randn(1, 1, INDEX_HEADS, generator=gen).cuda()
    ik = torch.randn(1, n, INDEX_DIM, generator=gen).to("cuda", BF16)
    if kind == "reindex":
        blocks = torch.randperm(n // CAND_BLOCK, generator=gen)[:CAND_BLOCKS]
        vis = torch.zeros(n // CAND_BLOCK, CAND_BLOCK, dtype=torch.bool)
        vis[blocks] = True
        visible = vis.flatten().view(1, 1, n).cuda()
    else:
        visible = torch.ones(1, 1, n, dtype=torch.bool, device="cuda")
    idx = torch.randint(0, n, (1, 1, TOPK), generator=gen).cuda()
    # the pool listed once per step (for all Reindex layers of a pool): not part of the layer
    entries = pool_entry_list(visible, min(CAND_BLOCKS * CAND_BLOCK, n)) if kind == "reindex" else None
    scale = HEAD_DIM ** -0.5
    attn = attn_kernel.SparseAttentionLauncher()  # held: its workspace is reused across calls
    topk_kernel = StableTopkLauncher()  # the radix-select top-k OpSet("triton") runs
    plain = {"PDL": False}  # the same kernels without programmatic dependent launch
    attn_plain, topk_plain = attn_kernel.SparseAttentionLauncher(overrides=plain), StableTopkLauncher(overrides=plain)

    def layer(topk=topk_kernel, attn=attn, over=None, listed=entries is not None):
        sel = idx  # what OpSet("triton") runs: index, top-k, attention
        if listed:
            scores = csa2_index_score_pooled(iq, iw, ik, entries, overrides=over)
            sel = select_listed_topk(scores, entries, TOPK, n, topk=topk, picks=listed_picks)
        elif kind != "reuse":
            scores = index_kernel.csa2_index_score(iq, iw, ik, visible, overrides=over)
            sel = topk(scores, TOPK)[1]
        return attn(q, kv, sel, win, wmask, sink, scale)

    out = {"layer_us": 1e3 * time_ms(layer, graph=True)}
    if entries is not None:
        out["layer_mask_us"] = 1e3 * time_ms(lambda: layer(listed=False), graph=True)
        if not torch.equal(layer(), layer(listed=False)):
            log.warning("the listed Reindex layer differs from the mask form (%d entries)", n)
    def plain_layer():
        return layer(topk_plain, attn_plain, plain)

    if not torch.equal(layer(), plain_layer()):
        log.warning("the layer with PDL differs from the one without (%s, %d entries)", kind, n)
    out["layer_plain_us"] = 1e3 * time_ms(plain_layer, graph=True)
    if kind != "reuse":
        out["layer_sort_us"] = 1e3 * time_ms(lambda: layer(stable_topk_reference), graph=True)
        scores = index_kernel.csa2_index_score(iq, iw, ik, visible)
        if not torch.equal(topk_kernel(scores, TOPK)[1], stable_topk_reference(scores, TOPK)[1]):
            log.warning("top-k kernel differs from the stable sort (%s, %d entries)", kind, n)
        out["index_us"] = 1e3 * time_ms(lambda: index_kernel.csa2_index_score(iq, iw, ik, visible), graph=True)
        if entries is not None:  # the listed pool's index kernel (the mask form's is index_us)
            out["index_listed_us"] = 1e3 * time_ms(lambda: csa2_index_score_pooled(iq, iw, ik, entries),
                                                   graph=True)
        codes, exps = fp4_pow2_pack(ik)  # the release's FP4 index keys: 68 B per entry
        out["index_fp4_us"] = 1e3 * time_ms(
            lambda: index_kernel.csa2_index_score_fp4(iq, iw, codes, exps, visible), graph=True)
        for path in ("mma", "decode"):  # both FP4 paths at every size (the launcher picks by size)
            out[f"index_fp4_{path}_us"] = 1e3 * time_ms(lambda: index_kernel.csa2_index_score_fp4(
                iq, iw, codes, exps, visible, overrides={"PATH": path}), graph=True)
        out["topk_us"] = 1e3 * time_ms(lambda: stable_topk_reference(scores, TOPK), graph=True)
        out["topk_kernel_us"] = 1e3 * time_ms(lambda: topk_kernel(scores, TOPK), graph=True)
        out["topk_kernel_plain_us"] = 1e3 * time_ms(lambda: topk_plain(scores, TOPK), graph=True)
        out["torch_topk_us"] = 1e3 * time_ms(lambda: scores.topk(TOPK, dim=-1), graph=True)  # not stable
        n_keys = visible.sum().item() if kind == "reindex" else n
        out["index_bytes"] = index_bytes(1, n, n_keys)
        out["index_fp4_bytes"] = index_bytes(1, n, n_keys, fp4=True)
    out["attn_us"] = 1e3 * time_ms(lambda: attn(q, kv, idx, win, wmask, sink, scale), graph=True)
    # the same with the L2 cache overwritten before each call (time_cold_ms): the index keys fit
    # in the H200's L2 up to 128K entries, so the back-to-back replays above read them from there
    out["layer_cold_us"] = 1e3 * time_cold_ms(layer)
    out["layer_single_us"] = 1e3 * time_cold_ms(layer, cold=False)
    if kind != "reuse":
        def index_only():
            return index_kernel.csa2_index_score(iq, iw, ik, visible)
        out["index_cold_us"] = 1e3 * time_cold_ms(index_only)
        out["index_single_us"] = 1e3 * time_cold_ms(index_only, cold=False)
    out["attn_bytes"] = attn_bytes(1)
    if kind == "full" and ctx <= 32768:  # the eager reference of the same layer
        def eager():
            s = index_ref.csa2_index_score(iq, iw, ik, visible)
            return attn_ref.csa2_sparse_attention(q, kv, s.topk(TOPK, dim=-1).indices, win, wmask, sink, scale)
        out["eager_us"] = 1e3 * time_ms(eager)
    return out


def sdpa_dense(ctx: int, gen) -> float:
    """PyTorch SDPA of one decode row over the uncompressed latent KV (MQA: one KV head, K = V)."""
    q = torch.randn(1, HEADS, 1, HEAD_DIM, generator=gen).to("cuda", BF16)
    kv = torch.randn(1, 1, ctx, HEAD_DIM, generator=gen).to("cuda", BF16)
    f = torch.nn.functional.scaled_dot_product_attention
    return 1e3 * time_ms(lambda: f(q, kv, kv, enable_gqa=True))


def mhc_inputs(tokens: int, gen) -> list:
    n_mix = (2 + HC) * HC
    return [torch.randn(1, tokens, HC, HIDDEN, generator=gen).to(BF16),
            torch.randn(1, tokens, HIDDEN, generator=gen).to(BF16),
            torch.rand(1, tokens, HC, generator=gen) * 2, torch.rand(1, tokens, HC, HC, generator=gen),
            torch.rand(1, tokens, HC, generator=gen) + 0.5,
            torch.randn(n_mix, HC * HIDDEN, generator=gen) * 0.01, torch.randn(n_mix, generator=gen),
            torch.rand(3, generator=gen) + 0.5, (torch.rand(HIDDEN, generator=gen) + 0.5).to(BF16)]


def mhc_case(tokens: int, gen) -> dict:
    n_mix = (2 + HC) * HC
    args = [a.cuda() for a in mhc_inputs(tokens, gen)] + [20, 1e-6, 1e-6]
    launcher = mhc_kernel.MhcBoundaryLauncher()
    small = tokens <= 64
    k_ms = time_ms(lambda: launcher(*args), graph=small)
    r_ms = time_ms(lambda: mhc_ref.mhc_boundary(*args))
    e = HIDDEN
    per_token = HC * e * 2 * 2 + e * 2 + 3 * e * 2 + (2 * HC + HC * HC) * 4 * 2 + HC * 4 * 2
    total = tokens * per_token + n_mix * HC * e * 4 + e * 2
    return {"kernel_us": 1e3 * k_ms, "eager_us": 1e3 * r_ms, "bytes": total}


def _close(got, want, rel: float) -> bool:
    """A sweep setting counts only if it computes the same thing as the default one: the same
    infinities (index scores of entries not visible) and close finite values."""
    def same(g, w):
        g, w = g.float(), w.float()
        finite = torch.isfinite(w)
        if not torch.equal(torch.isfinite(g), finite) or not torch.equal(g[~finite], w[~finite]):
            return False
        g, w = g[finite], w[finite]
        return w.numel() == 0 or torch.allclose(g, w, rtol=rel, atol=rel * w.abs().max().item())
    return all(same(g, w) for g, w in zip(got, want))


def _sweep_one(res: dict, label: str, make, call, want, rel: float, graph: bool) -> None:
    """Time one launch setting, after checking its output against the default setting's; logged
    as it goes, so a run cut short still reports what it measured."""
    try:
        f = make()
        got = call(f)
        got = got if isinstance(got, (tuple, list)) else (got,)
        if not _close(got, want, rel):
            log.warning("sweep %s: WRONG result, not timed", label)
            res[label] = float("nan")
            return
        res[label] = 1e3 * time_ms(lambda: call(f), graph=graph)
        log.info("sweep %s: %.1f us", label, res[label])
    except Exception as exc:  # a setting that does not fit (shared memory, registers)
        log.info("sweep %s: %s", label, str(exc).splitlines()[0][:100])


SWEEPS = ("attn", "topk", "index", "fp4", "mhc")


def sweep(gen, parts: tuple = SWEEPS) -> dict:
    """Launch parameters of the attention, top-k, FP4 index and mHC kernels at decode and prefill
    sizes, each setting checked against the default one first; the defaults in launch_config
    come from these runs."""
    res = {}
    for part in parts:
        {"attn": _sweep_attention, "topk": _sweep_topk, "index": _sweep_index, "fp4": _sweep_index_fp4,
         "mhc": _sweep_mhc}[part](res, gen)
    return res


def _sweep_attention(res: dict, gen) -> None:
    for rows in (1, 64):
        q = torch.randn(1, rows, HEADS, HEAD_DIM, generator=gen).to("cuda", BF16)
        kv = torch.randn(1, 65536, HEAD_DIM, generator=gen).to("cuda", BF16)
        idx = torch.randint(0, 65536, (1, rows, TOPK), generator=gen).cuda()
        win = torch.randn(1, WINDOW + rows, HEAD_DIM, generator=gen).to("cuda", BF16)
        wmask = torch.ones(1, rows, WINDOW + rows, dtype=torch.bool, device="cuda")
        sink = torch.randn(HEADS, generator=gen).cuda()
        args = (q, kv, idx, win, wmask, sink, 0.04)
        want = (attn_kernel.SparseAttentionLauncher()(*args),)
        # n_split None: the launcher's choice (one key block per split at decode); 10: two blocks each
        grid = ([(16, 32, n, 4, 3) for n in (None, 10)] + [(16, 32, None, 8, 3), (16, 32, None, 4, 1)]
                if rows == 1 else [(16, 32, None, 4, 3), (32, 32, None, 4, 3), (32, 32, None, 8, 3),
                                   (32, 32, None, 4, 1)])
        for bh, bk, n_split, nw, stages in grid:
            over = dict(BLOCK_H=bh, BLOCK_K=bk, num_warps=nw, num_stages=stages)
            _sweep_one(res, f"attn rows={rows} {over} n_split={n_split}",
                       lambda: attn_kernel.SparseAttentionLauncher(overrides=over),
                       lambda f, n=n_split: f(*args, n_split=n), want, 1e-2, graph=True)


def _sweep_topk(res: dict, gen) -> None:
    scores = torch.relu(torch.randn(1, 131072, generator=gen)).cuda()  # ties at 0, as index scores
    want = stable_topk_reference(scores, TOPK)
    configs = [{}, {"PDL": False}, {"DIGITS": (6, 6, 6, 7, 7)}, {"CHUNK": 1024}, {"num_warps": 2},
               {"RANK_BLOCK": 8}, {"RANK_BLOCK": 16}, {"RANK_BLOCK": 4, "CMP_BLOCK": 512}]
    for over in configs:
        _sweep_one(res, f"topk n=131072 {over}", lambda over=over: StableTopkLauncher(overrides=over),
                   lambda f: f(scores, TOPK), want, 0.0, graph=True)


def _sweep_index(res: dict, gen) -> None:
    """bf16 index keys at 16K-128K entries, all visible (Full), and at 128K a 2,048 x 8 candidate
    pool (Reindex): block size, blocks per program (a software-pipelined loop of STAGES), warps;
    each timed back to back (keys in L2) and as one replay with L2 overwritten before it or not
    (time_cold_ms: their difference is what reading the keys from HBM costs)."""
    # {} is the launcher's choice (pipelined_config from 128K); BLOCKS 1 the one-block kernel
    configs = [{}, {"BLOCK_N": 64, "BLOCKS": 1, "num_warps": 4},
               {"BLOCK_N": 128, "BLOCKS": 1, "num_warps": 8}]
    configs += [{"BLOCK_N": bn, "BLOCKS": blocks, "STAGES": st, "num_warps": nw}
                for bn, blocks, st, nw in ((64, 2, 2, 4), (64, 4, 2, 4), (64, 8, 3, 4), (128, 2, 2, 8),
                                           (128, 2, 3, 8), (128, 4, 2, 8), (128, 4, 3, 8), (128, 4, 4, 8),
                                           (256, 2, 2, 8), (256, 4, 3, 8))]
    for n in (16384, 32768, 65536, 131072):
        iq = torch.randn(1, 1, INDEX_HEADS, INDEX_DIM, generator=gen).to("cuda", BF16)
        iw = torch.randn(1, 1, INDEX_HEADS, generator=gen).cuda()
        ik = torch.randn(1, n, INDEX_DIM, generator=gen).to("cuda", BF16)
        kinds = [("full", torch.ones(1, 1, n, dtype=torch.bool))]
        if n == 131072:
            pool = torch.zeros(n // CAND_BLOCK, CAND_BLOCK, dtype=torch.bool)
            pool[torch.randperm(n // CAND_BLOCK, generator=gen)[:CAND_BLOCKS]] = True
            kinds.append(("reindex", pool.view(1, 1, n)))
        for kind, visible in kinds:
            visible = visible.cuda()
            want = (index_kernel.csa2_index_score(iq, iw, ik, visible),)
            for over in configs:
                label = f"index n={n} {kind} {over}"
                def call(f, visible=visible, ik=ik, iq=iq, iw=iw):
                    return index_kernel.csa2_index_score(iq, iw, ik, visible, overrides=f)
                _sweep_one(res, label, lambda over=over: over, call, want, 1e-4, graph=True)
                if not math.isnan(res.get(label, math.nan)):  # it fits and computes the same: also from HBM
                    res[label + " cold"] = 1e3 * time_cold_ms(lambda over=over, call=call: call(over))
                    res[label + " single"] = 1e3 * time_cold_ms(lambda over=over, call=call: call(over),
                                                                cold=False)


def _sweep_index_fp4(res: dict, gen) -> None:
    n = 131072  # FP4 index keys at 128K entries: block sizes, warps
    iq = torch.randn(1, 1, INDEX_HEADS, INDEX_DIM, generator=gen).to("cuda", BF16)
    iw = torch.randn(1, 1, INDEX_HEADS, generator=gen).cuda()
    codes, exps = fp4_pow2_pack(torch.randn(1, n, INDEX_DIM, generator=gen).cuda())
    visible = torch.ones(1, 1, n, dtype=torch.bool, device="cuda")
    want = (index_kernel.csa2_index_score_fp4(iq, iw, codes, exps, visible),)
    for block_n, blocks, nw in ((64, 4, 4), (64, 2, 4), (64, 8, 4), (128, 2, 8)):
        over = dict(PATH="mma", BLOCK_N=block_n, BLOCKS=blocks, num_warps=nw)
        _sweep_one(res, f"index fp4 n={n} {over}", lambda: over,
                   lambda f: index_kernel.csa2_index_score_fp4(iq, iw, codes, exps, visible, overrides=f),
                   want, 1e-2, graph=True)


def _sweep_mhc(res: dict, gen) -> None:
    for tokens in (1, 4, 16, 8192):
        args = [t.cuda() for t in mhc_inputs(tokens, gen)] + [20, 1e-6, 1e-6]
        want = mhc_kernel.MhcBoundaryLauncher()(*args)
        few = tokens <= 64
        # num_stages: how deep Triton's software pipeline runs the channel loop's loads
        # (block tokens, block channels, warps, stages, channel splits; None: the launcher's
        # defaults): at 8,192 tokens whole rows make only 128-256 programs of 160-320 chunks
        # each; splitting the channels too (partials merged by the last program of a token
        # block) gives more, shorter programs. Whole rows are what the TensorRT plugin runs.
        # (4 and 16 tokens, one row per program: a finishing program per token, not one per block)
        grid = ([None, (1, 64, 4, 3, None), (1, 32, 4, 3, None)] if few else
                [None, (64, 32, 4, 3, 2), (64, 32, 4, 4, 2), (32, 32, 4, 4, 1), None, (64, 16, 4, 4, 1),
                 (64, 32, 8, 4, 1), None])
        for i, setting in enumerate(grid):
            bt, be, nw, stages, n_split = setting or (0, 0, 0, 0, None)
            over = dict(BLOCK_E=be, BLOCK_T=bt, num_warps=nw, num_stages=stages) if setting else {}
            _sweep_one(res, f"mhc tokens={tokens} #{i} {over or 'default'} n_split={n_split}",
                       lambda over=over: mhc_kernel.MhcBoundaryLauncher(overrides=over),
                       lambda f, n_split=n_split: f(*args, n_split=n_split), want, 2e-2, graph=few)
        if not few:  # what fn's bytes cost: every program streams all of fn from L2 (2 MB in fp32)
            half = list(args)
            half[5] = args[5].to(torch.float16)
            f = mhc_kernel.MhcBoundaryLauncher()
            label = "mhc tokens=8192 default, fn in fp16 (diagnostic: half the fn bytes)"
            res[label] = 1e3 * time_ms(lambda: f(*half))
            log.info("sweep %s: %.1f us", label, res[label])
        if tokens == 1:  # what the Sinkhorn epilogue costs: the same launch with one iteration
            one = args[:-3] + [1, 1e-6, 1e-6]
            f = mhc_kernel.MhcBoundaryLauncher()
            res["mhc tokens=1 sinkhorn iters=1 (diagnostic)"] = 1e3 * time_ms(lambda: f(*one), graph=True)
            log.info("sweep mhc tokens=1 sinkhorn iters=1: %.1f us", res["mhc tokens=1 sinkhorn iters=1 (diagnostic)"])


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    ctxs = sorted(int(c) for c in results["sdpa_us"])
    a.plot(ctxs, [results["sdpa_us"][str(c)] for c in ctxs], "o-", label="PyTorch SDPA, uncompressed KV")
    a.plot(ctxs, [results["dense_roofline_us"][str(c)] for c in ctxs], "k--", label="dense roofline (KV read once)")
    for kind in ("full", "reindex", "reuse"):
        a.plot(ctxs, [results["csa2"][kind][str(c)]["layer_us"] for c in ctxs], "o-", label=f"CSA2 {kind} layer (kernels)")
    a.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode time per layer (us)",
          title="CSA2 decode attention, H200, bf16")
    a.legend(fontsize=8)
    labels = list(results["engram"]["hbm"])
    b.bar(range(len(labels)), [results["engram"]["hbm"][k]["gathered_GBps"] for k in labels], label="table in HBM")
    b.bar(range(len(labels)), [results["engram"]["pinned"][k]["gathered_GBps"] for k in labels], label="pinned host table")
    b.axhline(results["ceilings"]["gather_GBps"], color="k", ls="--", label="index_select random-row gather")
    b.set_xticks(range(len(labels)), labels, rotation=30, fontsize=8)
    b.set(ylabel="gathered GB/s", title="Engram hash + gather")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    ap.add_argument("--sweep", action="store_true", help="also sweep launch parameters")
    ap.add_argument("--csa2-only", action="store_true", help="only the CSA2 layer table")
    ap.add_argument("--sweep-only", action="store_true", help="only the launch-parameter sweep")
    ap.add_argument("--sweep-parts", default=",".join(SWEEPS), help=f"which sweeps, of {','.join(SWEEPS)}")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    if args.sweep_only:
        parts = tuple(p for p in args.sweep_parts.split(",") if p)
        bad = [p for p in parts if p not in SWEEPS]
        if bad:
            ap.error(f"unknown sweep parts {bad}; known: {SWEEPS}")
        (out / "sweep.json").write_text(json.dumps(sweep(gen, parts), indent=1))
        return
    res = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "triton": triton.__version__, "ceilings": ceilings(args.quick)}
    bw = res["ceilings"]["copy_GBps"]
    ctxs = [4096, 131072] if args.quick else [4096, 16384, 32768, 65536, 131072]
    res["sdpa_us"], res["dense_roofline_us"] = {}, {}
    res["csa2"] = {k: {} for k in ("full", "reindex", "reuse")}
    for ctx in tqdm(ctxs, desc="csa2"):
        res["sdpa_us"][str(ctx)] = sdpa_dense(ctx, gen)
        res["dense_roofline_us"][str(ctx)] = ctx * HEAD_DIM * 2 / bw / 1e3
        for kind in res["csa2"]:
            res["csa2"][kind][str(ctx)] = csa2_layer(kind, ctx, gen)
        torch.cuda.empty_cache()
    if args.csa2_only:
        (out / "bench_csa2.json").write_text(json.dumps(res, indent=1))
        report(res)
        return
    rows = (4 << 20) if args.quick else (8 << 20)
    table = torch.randn(rows, ENGRAM_DIM, dtype=BF16, device="cuda")
    host = torch.empty(rows, ENGRAM_DIM, dtype=BF16).pin_memory()
    host.copy_(table.cpu())
    res["engram"] = {"hbm": {}, "pinned": {}}
    for batch, new in tqdm([(1, 1), (8, 1), (64, 1), (256, 1), (1, 8192)], desc="engram"):
        label = f"decode b={batch}" if new == 1 else f"prefill {new}"
        res["engram"]["hbm"][label] = engram_case(batch, new, table, gen)
        res["engram"]["pinned"][label] = engram_case(batch, new, host, gen)
    del table, host
    res["mhc"] = {str(t): mhc_case(t, gen) for t in tqdm([1, 64, 8192], desc="mhc")}
    (out / "bench.json").write_text(json.dumps(res, indent=1))
    plot(res, out / "bench.png")
    report(res)
    if args.sweep:
        res["sweep_us"] = sweep(gen)
        for case in ("topk n=131072", "index n=131072 full", "index n=131072 reindex", "index fp4",
                     "attn rows=1 ", "attn rows=64", "mhc tokens=1 ", "mhc tokens=8192"):
            best = sorted((us, k) for k, us in res["sweep_us"].items() if k.startswith(case) and not math.isnan(us))[:3]
            log.info("sweep best %s: %s", case, "; ".join(f"{us:.1f} us {k[len(case):]}" for us, k in best))
        (out / "bench.json").write_text(json.dumps(res, indent=1))


def cold_summary(f: dict, ri: dict, ru: dict, roof: float, bw: float) -> str:
    """One replay timed alone with L2 overwritten before it (cold) and with the data left in L2
    (single): their difference is what reading from HBM adds to the back-to-back figure (time_cold_ms)."""
    def hbm(d, what):
        return d[f"{what}_us"] + d[f"{what}_cold_us"] - d[f"{what}_single_us"]
    full, index = hbm(f, "layer"), hbm(f, "index")
    cases = (("full", f, "layer"), ("index", f, "index"), ("reindex", ri, "layer"), ("reuse", ru, "layer"))
    pairs = ", ".join(f"{name} {d[f'{what}_cold_us']:.1f} / {d[f'{what}_single_us']:.1f}"
                      for name, d, what in cases)
    index_frac = f["index_bytes"] / bw / 1e3 / index
    return (f"one replay, L2 overwritten / not: {pairs}; from HBM (back to back + cold - single): full "
            f"{full:.1f} ({roof / full:.2f}x), index {index:.1f} ({100 * index_frac:.0f}%), "
            f"reindex {hbm(ri, 'layer'):.1f}, reuse {hbm(ru, 'layer'):.1f}")


def report(res: dict) -> None:
    bw, gbw = res["ceilings"]["copy_GBps"], res["ceilings"]["gather_GBps"]
    lines = [f"{res['gpu']}  torch {res['torch']}  triton {res['triton']}  {res['date']}",
             f"ceilings: copy {bw:.0f} GB/s, index_select random-row gather {gbw:.0f} GB/s (gathered)"]
    lines.append("CSA2 decode layer (us): ctx | SDPA dense | dense roofline | full (x SDPA, x roofline) | "
                 "reindex | reuse | index kernel roofline% | attn kernel roofline%")
    for ctx, sd in res["sdpa_us"].items():
        roof = res["dense_roofline_us"][ctx]
        f, ri, ru = (res["csa2"][k][ctx] for k in ("full", "reindex", "reuse"))
        idx_frac = f["index_bytes"] / bw / 1e3 / f["index_us"]
        fp4_frac = f["index_fp4_bytes"] / bw / 1e3 / f["index_fp4_us"]
        att_frac = ru["attn_bytes"] / bw / 1e3 / ru["attn_us"]
        lines.append(f"  {ctx:>6} | {sd:9.1f} | {roof:6.1f} | {f['layer_us']:6.1f} ({sd / f['layer_us']:5.0f}x, "
                     f"{roof / f['layer_us']:4.1f}x; no PDL {f['layer_plain_us']:.1f}) [index {f['index_us']:.1f} "
                     f"top-k kernel {f['topk_kernel_us']:.1f} (no PDL {f['topk_kernel_plain_us']:.1f}) "
                     f"attn {f['attn_us']:.1f}] | {ri['layer_us']:6.1f} "
                     f"({roof / ri['layer_us']:4.1f}x; no PDL {ri['layer_plain_us']:.1f}) | {ru['layer_us']:5.1f} "
                     f"({roof / ru['layer_us']:4.1f}x; no PDL {ru['layer_plain_us']:.1f}) | {100 * idx_frac:4.0f}% | "
                     f"{100 * att_frac:4.0f}% | stable sort {f['topk_us']:.1f} (full layer with it "
                     f"{f['layer_sort_us']:.1f}), torch.topk {f['torch_topk_us']:.1f} | index over FP4 "
                     f"keys {f['index_fp4_us']:.1f} ({100 * fp4_frac:.0f}% of its roofline; FP8 tensor cores "
                     f"{f['index_fp4_mma_us']:.1f}, decoding to bf16 {f['index_fp4_decode_us']:.1f}) | "
                     + cold_summary(f, ri, ru, roof, bw))
    lines.append("Engram gather: case | HBM us, GB/s (% of gather ceiling) | eager us | pinned host GB/s")
    for label, h in res.get("engram", {}).get("hbm", {}).items():
        p = res["engram"]["pinned"][label]
        lines.append(f"  {label:>12} | {h['kernel_us']:8.1f} {h['gathered_GBps']:7.0f} ({100 * h['gathered_GBps'] / gbw:3.0f}%)"
                     f" | {h['eager_us']:8.1f} | {p['gathered_GBps']:6.1f}")
    lines.append("MhcBoundary: tokens | kernel us | eager us | speedup | roofline %")
    for t, m in res.get("mhc", {}).items():
        lines.append(f"  {t:>6} | {m['kernel_us']:8.1f} | {m['eager_us']:8.1f} | {m['eager_us'] / m['kernel_us']:6.1f}x"
                     f" | {100 * m['bytes'] / bw / 1e3 / m['kernel_us']:4.0f}%")
    text = "\n".join(lines)
    log.info("\n%s", text)


if __name__ == "__main__":
    main()
