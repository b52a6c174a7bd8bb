#!/usr/bin/env python3
"""One routed MoE layer of a preset (default flash: 384 experts of 2304 x 5120, k = 6; bf16, 27 GB
of stacked experts) on the GPU, in the two forms an exported decoder_step can take
(scripts/export.py --decode-moe): dense (every expert on every row, `MoE._dense_dispatch`) and
gathered (each row's k experts gathered from the stacks, `MoE._gathered_dispatch`), at decode
row counts. PyTorch eager, CUDA-graph replays; the graphs run the same ops through ONNX Runtime
or TensorRT. Counted bytes: dense reads the 3 x E expert matrices once; gathered reads each row's
3 x k matrices, writes the copies and reads them again (3 passes). Each form's roofline is its
bytes at the measured copy bandwidth. Also checks the two forms agree. Prints a table; writes
bench_moe_dispatch.json.

    python scripts/bench_moe_dispatch.py --out gpu_out [--config flash] [--rows 1,4,16,32]
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
import triton.testing
from tqdm import tqdm

from dsflash.model.config import ModelConfig
from dsflash.model.moe import MoE

log = logging.getLogger("bench_moe_dispatch")


def copy_GBps() -> float:
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median")
    return 2 * src.numel() * 2 / ms / 1e6


def graph_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def moe_layer(cfg: ModelConfig) -> MoE:
    """The preset's routed MoE, bf16 on the GPU, random weights (made there: no host copy)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"), torch.no_grad():
            moe = MoE(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    return moe


def measure(moe: MoE, rows: int, gen: torch.Generator) -> dict:
    hidden, experts, k = moe.gate.weight.shape[1], moe.n_routed, moe.gate.top_k
    x = torch.randn(rows, hidden, generator=gen).to("cuda", torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(rows)]).to("cuda")
    w = torch.rand(rows, k, generator=gen).to("cuda")
    with torch.no_grad():
        dense = moe._dense_dispatch(x, idx, w)
        gathered = moe._gathered_dispatch(x, idx, w)
        scale = dense.abs().max().item()
        diff = (dense - gathered).abs().max().item()
        if not diff <= 2e-2 * max(scale, 1e-6):  # bf16 products, fp32 sums in another order
            raise AssertionError(f"{rows} rows: the forms differ by {diff:.3g} (largest {scale:.3g})")
        res = {"rows": rows, "max_abs_diff": diff}
        for name, fn in (("dense", moe._dense_dispatch), ("gathered", moe._gathered_dispatch)):
            res[f"{name}_us"] = graph_us(lambda: fn(x, idx, w))
    matrix = moe.experts[0].w1.weight.numel() * 2
    res["dense_bytes"] = 3 * experts * matrix
    res["gathered_bytes"] = 3 * 3 * rows * k * matrix
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--config", default="flash", choices=["tiny", "small", "flash"])
    ap.add_argument("--rows", default="1,4,16,32",
                    help="decode rows (flash's gathered form at 64 rows holds 27 GB of copies)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    rows = [int(r) for r in args.rows.split(",")]
    if min(rows) < 1:
        ap.error(f"--rows {args.rows}: each must be >= 1")
    cfg = ModelConfig.preset(args.config)
    if not cfg.n_routed_experts:
        ap.error(f"--config {args.config} has no routed experts")
    bw = copy_GBps()
    moe = moe_layer(cfg)
    gen = torch.Generator().manual_seed(args.seed)
    results = [measure(moe, r, gen) for r in tqdm(rows, desc="rows")]
    meta = {"config": args.config, "gpu": torch.cuda.get_device_name(), "copy_GBps": bw,
            "experts": cfg.n_routed_experts, "k": cfg.num_experts_per_tok}
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"meta": meta, "results": results}
    (args.out / "bench_moe_dispatch.json").write_text(json.dumps(res, indent=1))
    lines = [f"one routed MoE layer, {args.config}, bf16, {meta['gpu']}, copy {bw:.0f} GB/s; "
             "us (graph replays)",
             "| rows | dense | gathered | dense / gathered | dense roofline | gathered roofline |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        roof = {f: r[f"{f}_bytes"] / bw / 1e3 for f in ("dense", "gathered")}
        lines.append(f"| {r['rows']} | {r['dense_us']:.1f} | {r['gathered_us']:.1f} | "
                     f"{r['dense_us'] / r['gathered_us']:.2f}x | {roof['dense'] / r['dense_us']:.0%} | "
                     f"{roof['gathered'] / r['gathered_us']:.0%} |")
    log.info("\n%s", "\n".join(lines))


if __name__ == "__main__":
    main()
