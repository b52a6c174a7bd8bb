#!/usr/bin/env python3
"""Where the sparse attention's time goes at a decode batch: the same launch (released sizes, 64
heads x 512, 512 picks + the 128-key window per row, 128K entries per row) timed over four
patterns of picks, so the gather's share can be told from the products' and softmax's:

- `random`: picks spread over the row's 128K entries (what a decode step reads; HBM);
- `contiguous`: entries 0..511 of each row (whole lines in order; L2-resident when warm);
- `one_entry`: every pick the same entry (each program re-reads one 1 KB row: no memory cost);
- `none`: no picks (-1), the window only (a fifth of the keys).

    python3 scripts/attention_ablation.py --rows 1,64 [--attn-over KEY=VALUE,...] [--splits 1,2] [--out DIR]

Times are medians of warm CUDA-graph replays (triton.testing.do_bench_cudagraph: no host
launch cost); the random case is the one a
serving GPU sees, the others bound what faster gathers could give.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import bench_kernels as bench
import torch
from bench_layer_batch import parse_overrides

from dsflash.plugins.csa2_sparse_attention import kernel as attn_kernel

log = logging.getLogger("attention_ablation")

PATTERNS = ("random", "contiguous", "one_entry", "none")


def picks(pattern: str, rows: int, n: int, gen) -> torch.Tensor:
    """[rows, 1, TOPK] entry ids of one pattern."""
    shape = (rows, 1, bench.TOPK)
    if pattern == "random":
        return torch.randint(0, n, shape, generator=gen, device="cuda")
    if pattern == "contiguous":
        return torch.arange(bench.TOPK, device="cuda").expand(shape).contiguous()
    if pattern == "one_entry":
        return torch.zeros(shape, dtype=torch.int64, device="cuda")
    if pattern == "none":
        return torch.full(shape, -1, dtype=torch.int64, device="cuda")
    raise ValueError(f"unknown pattern {pattern!r}; one of {PATTERNS}")


def run(rows: int, n: int, over: dict, gen, n_split: int | None = None) -> dict:
    def randn(*shape, dtype=bench.BF16):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype)

    q, kv, win = randn(rows, 1, bench.HEADS, bench.HEAD_DIM), randn(rows, n, bench.HEAD_DIM), \
        randn(rows, bench.WINDOW, bench.HEAD_DIM)
    wmask = torch.ones(rows, 1, bench.WINDOW, dtype=torch.bool, device="cuda")
    sink = randn(bench.HEADS, dtype=torch.float32)
    launcher = attn_kernel.SparseAttentionLauncher(overrides=over or None)
    out = {}
    for pattern in PATTERNS:
        idx = picks(pattern, rows, n, gen)
        out[pattern] = 1e3 * bench.time_ms(
            lambda idx=idx: launcher(q, kv, idx, win, wmask, sink, bench.HEAD_DIM ** -0.5, n_split=n_split),
            graph=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,64", help="query rows per launch, comma-separated")
    ap.add_argument("--entries", type=int, default=131072, help="entries per row")
    ap.add_argument("--attn-over", default="", help="launcher overrides KEY=VALUE,...")
    ap.add_argument("--splits", default="", help="key splits per row to time, comma-separated (default: "
                    "the launcher's choice)")
    ap.add_argument("--out", type=Path, help="folder for attention_ablation.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        over = parse_overrides(args.attn_over, attn_kernel.SparseAttentionLauncher.OVERRIDES, "--attn-over",
                               "sparse attention")
    except ValueError as err:
        ap.error(str(err))
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "entries": args.entries, "over": over, "rows": {}}
    log.info("%6s %6s %10s %12s %11s %8s  (us)", "rows", "splits", *PATTERNS)
    for rows in (int(r) for r in args.rows.split(",")):
        for n_split in [int(x) for x in args.splits.split(",") if x] or [None]:
            t = run(rows, args.entries, over, gen, n_split)
            res["rows"][f"{rows}" if n_split is None else f"{rows}x{n_split}"] = t
            log.info("%6d %6s %10.1f %12.1f %11.1f %8.1f", rows, n_split or "auto", *(t[p] for p in PATTERNS))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention_ablation.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
