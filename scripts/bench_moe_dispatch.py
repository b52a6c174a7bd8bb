#!/usr/bin/env python3
"""One routed MoE layer of a preset (default flash: 384 experts of 2304 x 5120, k = 6; bf16, 27 GB
of stacked experts) on the GPU, in the two forms an exported decoder_step can take
(scripts/export.py --decode-moe): dense (every expert on every row, `MoE._dense_dispatch`) and
gathered (each row's k experts gathered from the stacks, `MoE._gathered_dispatch`), at decode
row counts. PyTorch eager, CUDA-graph replays; the graphs run the same ops through ONNX Runtime
or TensorRT. Counted bytes: dense reads the 3 x E expert matrices once; gathered reads each row's
3 x k matrices, writes the copies and reads them again (3 passes). Each form's roofline is its
bytes at the measured copy bandwidth. Also checks both forms against the expert loop in fp32
(the gathered one within PIPELINE.md §7's bound of the dense one's error). Prints a table; writes
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
from bench_decode import copy_bandwidth_GBps
from tqdm import tqdm

from dsflash.export.tolerances import kernel_bound
from dsflash.model.config import ModelConfig
from dsflash.model.moe import MoE, clamp_silu_mul

log = logging.getLogger("bench_moe_dispatch")


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


def routed_fp32(moe: MoE, x_TE: torch.Tensor, idx_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """The routed experts' output in fp32, row by row (each row's k experts cast to fp32: 850 MB at
    flash), the expert loop's maths: the reference both forms are held to."""
    w1, w3, w2 = moe.stacked_weights()
    out = []
    for t in range(x_TE.shape[0]):
        x = x_TE[t].float()
        acc = torch.zeros_like(x)
        for e, weight in zip(idx_TK[t].tolist(), w_TK[t].tolist()):
            h = clamp_silu_mul(w1[e].float() @ x, w3[e].float() @ x, moe.limit) * weight
            acc += w2[e].float() @ h
        out.append(acc)
    return torch.stack(out)


def measure(moe: MoE, rows: int, gen: torch.Generator) -> dict:
    hidden, experts, k = moe.gate.weight.shape[1], moe.n_routed, moe.gate.top_k
    x = torch.randn(rows, hidden, generator=gen).to("cuda", torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(rows)]).to("cuda")
    w = torch.rand(rows, k, generator=gen).to("cuda")
    with torch.no_grad():
        exact = routed_fp32(moe, x, idx, w)
        err = {name: (fn(x, idx, w) - exact).abs().max().item()
               for name, fn in (("dense", moe._dense_dispatch), ("gathered", moe._gathered_dispatch))}
        # PIPELINE.md §7: the gathered form within the rule's bound of the dense form's own error
        if not err["gathered"] <= kernel_bound(err["dense"], torch.bfloat16):
            raise AssertionError(f"{rows} rows: gathered error {err['gathered']:.3g} against fp32 exceeds "
                                 f"the bound of the dense form's {err['dense']:.3g}")
        res = {"rows": rows, "dense_err": err["dense"], "gathered_err": err["gathered"]}
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
    bw = copy_bandwidth_GBps("cuda")
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
