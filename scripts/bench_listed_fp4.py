#!/usr/bin/env python3
"""The listed pool's FP4 index kernel at a decode batch (a Reindex layer of the flash preset: 16,384
listed slots of 128K entries per row, 32 heads x 128): Triton's pipelined kernel (pooled_fp4.py)
against the Gluon kernel (listed_fp4_gluon.py) in the same run, each timed as a CUDA-graph replay
after a 256 MB read has evicted the L2 (what a decode layer sees). Counted bytes per row: each slot's
id, 64 B of codes, 4 B of exponents and its score, plus the queries and head weights; the roofline is
those bytes at the measured copy bandwidth. Every Gluon launch's scores are checked against
Triton's, bit for bit, before it is timed. Prints a table; writes bench_listed_fp4.json.

    python scripts/bench_listed_fp4.py --out gpu_out [--rows 1,8,16,32,64,96,128]
        [--queries qat|bf16] [--configs 64:16:6,128:16:4:128]   # BLOCK_N:BLOCKS:STAGES[:maxnreg]
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
from tqdm import tqdm

from bench_decode import copy_bandwidth_GBps
from bench_kernels import time_cold_ms
from dsflash.model.quant import fp4_pow2_qat
from dsflash.plugins.csa2_index_score.listed_fp4_gluon import (
    csa2_index_score_fp4_listed_gluon,
    listed_gluon_config,
)
from dsflash.plugins.csa2_index_score.pooled_fp4 import csa2_index_score_fp4_pooled, pooled_fp4_config

log = logging.getLogger("bench_listed_fp4")
HEADS, DIM, ENTRIES, SLOTS = 32, 128, 131072, 16384


def listed_bytes(rows: int, slots: int) -> int:
    """What the kernel must move: per slot its id (4 B), codes (64), exponents (4) and score (4);
    per row its bf16 queries and fp32 head weights."""
    return rows * (slots * (4 + DIM // 2 + DIM // 32 + 4) + HEADS * (DIM * 2 + 4))


def inputs(rows: int, queries: str, gen: torch.Generator) -> tuple:
    """Random FP4 keys (any code byte; exponents in [-8, 0], as unit-normal keys get), bf16 queries
    (kv_qat-rounded for "qat": no lo part, as the model makes them) and one sorted list of SLOTS
    distinct ids per row, the last 100 slots of every fourth row -1 (a pool not yet full)."""
    codes = torch.randint(0, 256, (rows, ENTRIES, DIM // 2), generator=gen, device="cuda", dtype=torch.uint8)
    exps = torch.randint(-8, 1, (rows, ENTRIES, DIM // 32), generator=gen, device="cuda", dtype=torch.int8)
    q = torch.randn(rows, 1, HEADS, DIM, generator=gen, device="cuda").to(torch.bfloat16)
    if queries == "qat":
        q = fp4_pow2_qat(q)
    w = torch.randn(rows, 1, HEADS, generator=gen, device="cuda")
    ids = torch.rand(rows, ENTRIES, generator=gen, device="cuda").argsort(dim=1)[:, :SLOTS].sort(dim=1).values
    ids[::4, -100:] = -1
    return q, w, codes, exps, ids.to(torch.int32).view(rows, 1, SLOTS)


def parse_configs(text: str) -> list[dict]:
    """--configs: BLOCK_N:BLOCKS:STAGES[:maxnreg] items; a malformed one exits naming it."""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) not in (3, 4) or not all(v.isdigit() for v in parts):
            raise SystemExit(f"--configs item {item!r} is not BLOCK_N:BLOCKS:STAGES[:maxnreg]")
        out.append(dict(zip(("BLOCK_N", "BLOCKS", "STAGES", "maxnreg"), map(int, parts))))
    return out


def bench_rows(rows: int, queries: str, configs: list[dict], gbps: float, gen: torch.Generator) -> dict:
    args = inputs(rows, queries, gen)
    want = csa2_index_score_fp4_pooled(*args)
    roof_us = listed_bytes(rows, SLOTS) / gbps / 1e3
    triton_us = 1e3 * time_cold_ms(lambda: csa2_index_score_fp4_pooled(*args))
    out = {"rows": rows, "roofline_us": roof_us, "triton": {"us": triton_us, "config": pooled_fp4_config(
        rows, SLOTS, args[0].device)}, "gluon": {}}
    for cfg in [{}] + configs:
        label = ":".join(str(v) for v in cfg.values()) or "default"
        got = csa2_index_score_fp4_listed_gluon(*args, overrides=cfg)
        equal = torch.equal(got, want)
        if not equal:
            log.error("Gluon %s differs from Triton at %d rows: largest difference %.3g", label, rows,
                      (got - want).abs().nan_to_num(0.0).max().item())
        us = 1e3 * time_cold_ms(lambda cfg=cfg: csa2_index_score_fp4_listed_gluon(*args, overrides=cfg))
        out["gluon"][label] = {"us": us, "equal_to_triton": equal,
                               "config": listed_gluon_config(rows, SLOTS) | cfg}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="1,8,16,32,64,96,128")
    ap.add_argument("--queries", choices=("qat", "bf16"), default="qat")
    ap.add_argument("--configs", default="",
                    help="extra Gluon launches, BLOCK_N:BLOCKS:STAGES[:maxnreg], comma-separated")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = [int(r) for r in a.rows.split(",")]
    if min(rows) < 1:
        raise SystemExit(f"--rows must be >= 1, got {a.rows}")
    configs = parse_configs(a.configs)
    if not torch.cuda.is_available():
        raise SystemExit("bench_listed_fp4.py needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    gbps = copy_bandwidth_GBps("cuda")
    results = []
    for r in tqdm(rows, desc="rows"):
        results.append(bench_rows(r, a.queries, configs, gbps, gen))
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "copy_GBps": gbps, "queries": a.queries, "slots": SLOTS,
              "entries": ENTRIES, "results": results}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_listed_fp4.json").write_text(json.dumps(report, indent=1))
    log.info("%s, copy %.0f GB/s, %s queries; us (fraction of the byte roofline)", report["device"], gbps,
             a.queries)
    for res in results:
        roof, tri = res["roofline_us"], res["triton"]["us"]
        cells = [f"triton {tri:7.1f} ({roof / tri:4.0%})"]
        for label, g in res["gluon"].items():
            mark = "" if g["equal_to_triton"] else " DIFFERS"
            cells.append(f"{label} {g['us']:7.1f} ({roof / g['us']:4.0%}, {tri / g['us']:.2f}x){mark}")
        log.info("%4d rows: %s", res["rows"], "  ".join(cells))


if __name__ == "__main__":
    main()
