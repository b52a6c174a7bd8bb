#!/usr/bin/env python3
"""The listed pool's index kernels at other pipeline depths and runs: each launch setting timed
against the kernel's default on a decode step's ids (index_fp4_ablation.listed_ids' `pool_blocks`:
the candidate pool's 2,048 random blocks of 8 of 128K entries per row), after its scores are
checked equal, bit for bit, to the default's (a setting that differs is reported and not timed).

- `fp4`: pooled_fp4.py (FP4 keys, kv_qat queries; the default pooled_fp4_config);
- `bf16`: pooled.py (bf16 keys; the default listed_pipelined_config);
- `probe`: index_fp4_ablation.listed_key_gather_kernel (the FP4 kernel's reads without its
  products), whose default is pooled_fp4_config's launch.

Why depth matters here: Triton's pipeliner spreads a loop's stages over the chain ids -> keys ->
products; at 3 or 4 stages each block's key copies are issued after the previous block's
products and waited for at the next block's start, at 5 they go two blocks ahead (docs/
benchmarks.md, session 43). Settings are STAGES:BLOCKS[:rREGS] (rREGS: a register cap, r0 none).
Each timed as one CUDA-graph replay after a 256 MB read has evicted the L2
(bench_kernels.time_cold_ms), the default and each setting alternately `--repeat` times. Writes
listed_stages_sweep.json.

    python3 scripts/listed_stages_sweep.py --out DIR [--rows 32,64] [--kernels fp4,bf16,probe]
        [--settings 3:16,5:8,5:16,6:8] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

log = logging.getLogger("listed_stages_sweep")
KERNELS = ("fp4", "bf16", "probe")


def parse_setting(text: str) -> dict:
    """'STAGES:BLOCKS[:rREGS]' -> launch overrides (maxnreg None for r0)."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[:2]) or \
            (len(parts) == 3 and not (parts[2].startswith("r") and parts[2][1:].isdigit())):
        raise SystemExit(f"--settings: each is STAGES:BLOCKS[:rREGS], got {text!r}")
    stages, blocks = int(parts[0]), int(parts[1])
    if stages < 1 or blocks < 1:
        raise SystemExit(f"--settings: STAGES and BLOCKS must be >= 1, got {text!r}")
    over = {"STAGES": stages, "BLOCKS": blocks}
    if len(parts) == 3:
        over["maxnreg"] = int(parts[2][1:]) or None
    return over


def kernel_runs(kernel: str, rows: int, gen: torch.Generator):
    """(a launch taking overrides, its default settings) for one kernel over `rows` rows."""
    from bench_kernels import INDEX_DIM, INDEX_HEADS
    from index_fp4_ablation import ENTRIES, fp4_inputs, listed_ids, listed_key_gather, slots

    from dsflash.plugins.csa2_index_score.pooled import csa2_index_score_pooled, listed_pipelined_config
    from dsflash.plugins.csa2_index_score.pooled_fp4 import csa2_index_score_fp4_pooled, pooled_fp4_config

    ids = listed_ids("pool_blocks", rows, gen)
    if kernel == "bf16":
        q = torch.randn(rows, 1, INDEX_HEADS, INDEX_DIM, generator=gen, device="cuda").to(torch.bfloat16)
        w = torch.randn(rows, 1, INDEX_HEADS, generator=gen, device="cuda")
        k = torch.randn(rows, ENTRIES, INDEX_DIM, generator=gen, device="cuda").to(torch.bfloat16)
        default = listed_pipelined_config(rows, slots(), INDEX_DIM, torch.bfloat16, q.device)
        return lambda over: csa2_index_score_pooled(q, w, k, ids, overrides=over), default
    codes, exps, q, w = fp4_inputs(rows, gen)
    default = pooled_fp4_config(rows, slots(), q.device)
    if kernel == "fp4":
        return lambda over: csa2_index_score_fp4_pooled(q, w, codes, exps, ids, overrides=over), default
    words = (codes.view(torch.int32), exps.view(torch.int32).view(rows, ENTRIES), ids.view(rows, -1))
    return lambda over: listed_key_gather(*words, default | over), default


def sweep(kernel: str, rows: int, settings: list[dict], repeat: int, gen: torch.Generator) -> dict:
    from bench_kernels import time_cold_ms

    run, default = kernel_runs(kernel, rows, gen)
    want = run({})
    out = {"kernel": kernel, "rows": rows, "default": {k: v for k, v in default.items()}, "us": {},
           "differs": []}
    timed = []
    for over in settings:
        if torch.equal(run(over), want):
            timed.append(over)
        else:
            out["differs"].append(over)
            log.warning("%s at %d rows: %s gives other scores than the default; not timed", kernel, rows,
                        over)
    for _ in range(repeat):
        for over in [{}] + timed:
            key = "default" if not over else ":".join(str(over[k]) for k in ("STAGES", "BLOCKS")) + \
                (f":r{over['maxnreg'] or 0}" if "maxnreg" in over else "")
            out["us"].setdefault(key, []).append(1e3 * time_cold_ms(lambda over=over: run(over)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="32,64")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--settings", default="3:16,5:8,5:16,6:8")
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = [int(r) for r in a.rows.split(",")]
    if min(rows) < 1:
        raise SystemExit(f"--rows must be >= 1, got {a.rows}")
    kernels = a.kernels.split(",")
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        raise SystemExit(f"--kernels: unknown {unknown}, known {list(KERNELS)}")
    if a.repeat < 1:
        raise SystemExit(f"--repeat must be >= 1, got {a.repeat}")
    settings = [parse_setting(s) for s in a.settings.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("listed_stages_sweep.py needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for kernel in kernels:
        for r in rows:
            res = sweep(kernel, r, settings, a.repeat, gen)
            results.append(res)
            cells = "  ".join(f"{k} {min(v):6.1f}" for k, v in res["us"].items())
            log.info("%-5s %4d rows (default %s:%s): %s", kernel, r, res["default"].get("STAGES"),
                     res["default"].get("BLOCKS"), cells)
            torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "results": results}
    (a.out / "listed_stages_sweep.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
