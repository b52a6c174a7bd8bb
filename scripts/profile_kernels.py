#!/usr/bin/env python3
"""Run one benchmark case a few times so Nsight Compute can read its kernels' counters (where a
timing alone does not say why a kernel is slow: occupancy, stalls, bytes moved per level).

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        -k regex:mhc_boundary -c 1 python3 scripts/profile_kernels.py --case mhc8192

Cases use the released sizes of scripts/bench_kernels.py. `--kernel-times` instead prints each
kernel's mean time over the repeats from torch.profiler (CUPTI), for a first look at which launch
of a multi-launch op takes the time (no ncu needed).
"""

from __future__ import annotations

import argparse
import contextlib
import logging

import bench_kernels as bench
import torch

from dsflash.model.quant import fp4_pow2_pack
from dsflash.plugins.csa2_index_score import kernel as index_kernel
from dsflash.plugins.csa2_sparse_attention import kernel as attn_kernel
from dsflash.plugins.mhc_boundary import kernel as mhc_kernel
from dsflash.plugins.stable_topk.kernel import StableTopkLauncher

log = logging.getLogger("profile_kernels")


def mhc(tokens: int, gen, n_split: int | None = None):
    args = [a.cuda() for a in bench.mhc_inputs(tokens, gen)] + [20, 1e-6, 1e-6]
    launcher = mhc_kernel.MhcBoundaryLauncher()
    return lambda: launcher(*args, n_split=n_split)


def topk(n: int, gen, rows: int = 1, form: str | None = None):
    scores = torch.relu(torch.randn(rows, n, generator=gen)).cuda()
    launcher = StableTopkLauncher(overrides={"FORM": form} if form else None)
    return lambda: launcher(scores, bench.TOPK)


def index_args(n: int, gen, batch: int = 1):
    iq = torch.randn(batch, 1, bench.INDEX_HEADS, bench.INDEX_DIM, generator=gen).to("cuda", bench.BF16)
    iw = torch.randn(batch, 1, bench.INDEX_HEADS, generator=gen).cuda()
    # made on the GPU: at a decode batch of 128K-entry rows the keys are GBs
    ik = torch.randn(batch, n, bench.INDEX_DIM, device="cuda", dtype=bench.BF16)
    return iq, iw, ik, torch.ones(batch, 1, n, dtype=torch.bool, device="cuda")


def index_bf16(n: int, gen):
    args = index_args(n, gen)
    return lambda: index_kernel.csa2_index_score(*args)


def index_fp4(n: int, gen, batch: int = 1):
    iq, iw, ik, visible = index_args(n, gen, batch)
    codes, exps = fp4_pow2_pack(ik.float())
    return lambda: index_kernel.csa2_index_score_fp4(iq, iw, codes, exps, visible)


def attention(n: int, gen, rows: int = 1):
    """The attention over `rows` query rows, each with its own n entries (made on the GPU: 64 rows
    of 128K are 8 GB), 512 picks and the 128-key window, as bench_layer_batch.py times it."""
    cuda = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))

    def randn(*shape, dtype=bench.BF16):
        return torch.randn(*shape, generator=cuda, device="cuda", dtype=dtype)

    q, kv, win = randn(rows, 1, bench.HEADS, bench.HEAD_DIM), randn(rows, n, bench.HEAD_DIM), \
        randn(rows, bench.WINDOW, bench.HEAD_DIM)
    idx = torch.randint(0, n, (rows, 1, bench.TOPK), generator=cuda, device="cuda")
    wmask = torch.ones(rows, 1, bench.WINDOW, dtype=torch.bool, device="cuda")
    sink = randn(bench.HEADS, dtype=torch.float32)
    launcher = attn_kernel.SparseAttentionLauncher()
    return lambda: launcher(q, kv, idx, win, wmask, sink, bench.HEAD_DIM ** -0.5)


def listed_layer(rows: int, gen, fp4: bool = True, ctx: int = 131072, topk_over: dict | None = None):
    """bench_layer_batch.py's listed Reindex layer (index over the listed pool, top-k writing the
    picks' entry ids, attention) at `rows` rows of `ctx` entries (128K), FP4 index keys on kv_qat
    queries or bf16 keys; `topk_over`: the top-k launcher's overrides (INDEX_MAXIMA: the index
    launch writes the block maxima the top-k takes)."""
    import bench_layer_batch as layers

    cuda = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    x = layers.layer_inputs(rows, ctx, cuda)
    attn, topk = attn_kernel.SparseAttentionLauncher(), StableTopkLauncher(overrides=topk_over)

    def layer():
        sel = layers.select_listed(topk, x, fp4, "iq_qat", ctx)  # OpSet("triton")'s form
        return attn(x["q"], x["kv"], sel, x["win"], x["wmask"], x["sink"], bench.HEAD_DIM ** -0.5)

    return layer


def timeline(fn, replays: int = 5) -> list[tuple[str, float, float]]:
    """(kernel, start us, duration us) of the middle one of `replays` back-to-back replays of fn
    captured as one CUDA graph, starts from that replay's first kernel."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return middle_replay([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA], replays)


def middle_replay(kernels: list[tuple[float, float, str]], replays: int) -> list[tuple[str, float, float]]:
    """The kernels (start, end, name) of `replays` replays of one graph, in start order, cut into
    replays of equal count: the middle one as (name, start, duration), starts from its first."""
    kernels = sorted(kernels)
    per = len(kernels) // replays
    if per == 0 or per * replays != len(kernels):
        raise RuntimeError(f"the profile holds {len(kernels)} kernels for {replays} replays")
    mine = kernels[per * (replays // 2):per * (replays // 2 + 1)]
    t0 = mine[0][0]
    return [(name, start - t0, end - start) for start, end, name in mine]


def timeline_lines(rows: list[tuple[str, float, float]]) -> list[str]:
    """One line per kernel (start, time, the gap since the kernel before it ended: negative where
    it started early, under programmatic dependent launch; its end, and how long after the kernel
    before it ended: its own share of the chain where the two overlap) and a total: the replay's
    span, the kernels' summed times and the difference."""
    lines, end, busy = [], 0.0, 0.0
    for i, (name, start, dur) in enumerate(rows):
        after = start + dur - end if i else dur
        lines.append(f"{start:8.2f} us  {dur:7.2f} us  gap {start - end if i else 0.0:6.2f} us  "
                     f"ends {start + dur:8.2f} us ({after:+.2f})  {name[:70]}")
        end, busy = start + dur, busy + dur
    lines.append(f"replay {end:.2f} us: kernels {busy:.2f} us, gaps {end - busy:.2f} us, {len(rows)} kernels")
    return lines


CASES = {"mhc8192": lambda g: mhc(8192, g), "mhc1": lambda g: mhc(1, g),
         "mhc8192_split4": lambda g: mhc(8192, g, n_split=4),
         "topk131072": lambda g: topk(131072, g),
         "topk131072_b64_radix": lambda g: topk(131072, g, rows=64, form="radix"),
         "topk131072_b64_block_max": lambda g: topk(131072, g, rows=64, form="prefilter"),
         "index_fp4_131072": lambda g: index_fp4(131072, g),
         "index_fp4_131072_b64": lambda g: index_fp4(131072, g, batch=64),
         "index131072": lambda g: index_bf16(131072, g),
         "attn_decode": lambda g: attention(65536, g),
         "attn131072_b64": lambda g: attention(131072, g, rows=64),
         **{f"layer_listed_fp4_b{r}": (lambda g, r=r: listed_layer(r, g)) for r in (1, 16, 32, 64, 128)},
         **{f"layer_listed_b{r}": (lambda g, r=r: listed_layer(r, g, fp4=False)) for r in (32, 64)},
         # with the index launch writing the block maxima (INDEX_MAXIMA, session 53)
         **{f"layer_listed{kind}_b32_maxima":
            (lambda g, fp4=fp4: listed_layer(32, g, fp4=fp4, topk_over={"INDEX_MAXIMA": True}))
            for kind, fp4 in (("", False), ("_fp4", True))}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=sorted(CASES), required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kernel-times", action="store_true",
                    help="print each kernel's mean time (torch.profiler)")
    ap.add_argument("--timeline", action="store_true",
                    help="print one CUDA-graph replay's kernels with their starts and gaps (torch.profiler)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    fn = CASES[args.case](torch.Generator().manual_seed(0))
    fn()  # compile and allocate outside the profile
    torch.cuda.synchronize()
    if args.timeline:
        for line in timeline_lines(timeline(fn)):
            log.info("%s", line)
        return
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if args.kernel_times \
            else contextlib.nullcontext() as prof:
        for _ in range(args.repeat):
            fn()
        torch.cuda.synchronize()
    if args.kernel_times:
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                log.info("%-40s %6d calls %9.1f us each", e.key[:40], e.count, e.device_time_total / e.count)


if __name__ == "__main__":
    main()
