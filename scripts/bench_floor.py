#!/usr/bin/env python3
"""What one launch costs on this GPU at all, graph-replayed (PIPELINE.md §8): the floor under any
decode-sized kernel, against which the decode targets of docs/benchmarks.md are judged.

- an empty kernel (80 programs): the launch and retire cost of one graph node;
- a dependent chain (80 programs): load an index, gather one 1 KB row at it, store the row:
  the shortest form of what sparse attention does per key block (index -> gather -> store);
- the same chain twice in a row: what one more dependent launch adds;
- chains of 8 dependent launches (the Full decode layer's count: index, 5 top-k, 2 attention),
  plain and with programmatic dependent launch (PDL, plugins/pdl.py: each kernel waits on the GPU
  for the one before, so its launch overlaps that one's run).

Each is timed by `triton.testing.do_bench_cudagraph` (median); the script prints a short table
and writes floor.json.

    python scripts/bench_floor.py --out gpu_out
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

from dsflash.plugins.pdl import pdl_launch_args, wait_for_earlier_grids

log = logging.getLogger("bench_floor")

PROGRAMS, ROW = 80, 512  # the decode attention's split grid; a 512-dim bf16 row (1 KB)
CHAIN = 8  # dependent launches in a Full decode layer


@triton.jit
def empty_kernel(x_ptr):
    pass


@triton.jit
def gather_chain_kernel(idx_ptr, src_ptr, dst_ptr, ROW: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_earlier_grids(PDL)
    p = tl.program_id(0)
    i = tl.load(idx_ptr + p)
    d = tl.arange(0, ROW)
    tl.store(dst_ptr + p * ROW + d, tl.load(src_ptr + i * ROW + d))


def graph_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")


def measure() -> dict:
    rows = 1 << 20
    src = torch.randn(rows, ROW, device="cuda").to(torch.bfloat16)
    idx = torch.randint(0, rows, (PROGRAMS,), device="cuda")
    dst = torch.empty(PROGRAMS, ROW, device="cuda", dtype=torch.bfloat16)
    dst2 = torch.empty_like(dst)
    chain_idx = torch.arange(PROGRAMS, device="cuda")

    def chain():
        gather_chain_kernel[(PROGRAMS,)](idx, src, dst, ROW=ROW)

    def chain_twice():  # the second launch reads what the first wrote
        gather_chain_kernel[(PROGRAMS,)](idx, src, dst, ROW=ROW)
        gather_chain_kernel[(PROGRAMS,)](chain_idx, dst, dst2, ROW=ROW)

    bufs = [dst] + [torch.empty_like(dst) for _ in range(CHAIN - 1)]

    def chain_of(pdl: dict):  # each launch gathers the rows the one before wrote
        def run():
            gather_chain_kernel[(PROGRAMS,)](idx, src, bufs[0], ROW=ROW, **pdl)
            for i in range(1, CHAIN):
                gather_chain_kernel[(PROGRAMS,)](chain_idx, bufs[i - 1], bufs[i], ROW=ROW, **pdl)
        return run

    chain()
    torch.cuda.synchronize()
    assert torch.equal(dst, src[idx]), "gather_chain_kernel gathered the wrong rows"
    res = {"gpu": torch.cuda.get_device_name(), "empty_us": graph_us(lambda: empty_kernel[(PROGRAMS,)](dst)),
           "gather_chain_us": graph_us(chain), "gather_chain_twice_us": graph_us(chain_twice)}
    pdl = pdl_launch_args(dst.device)
    for name, args in (("plain", {}), ("pdl", pdl)):
        run = chain_of(args)
        for b in bufs:
            b.zero_()
        res[f"chain{CHAIN}_{name}_us"] = graph_us(run)
        assert torch.equal(bufs[-1], src[idx]), f"the {name} chain of {CHAIN} launches lost rows"
    res["pdl_available"] = bool(pdl.get("PDL"))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    res = measure()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "floor.json").write_text(json.dumps(res, indent=1))
    log.info("launch floor (%s, graph replay, median): empty kernel %.2f us | index -> gather -> store "
             "%.2f us | the same chain twice %.2f us", res["gpu"], res["empty_us"],
             res["gather_chain_us"], res["gather_chain_twice_us"])
    log.info("%d dependent launches: plain %.2f us, with PDL %.2f us (PDL on this GPU: %s)", CHAIN,
             res[f"chain{CHAIN}_plain_us"], res[f"chain{CHAIN}_pdl_us"], res["pdl_available"])


if __name__ == "__main__":
    main()
