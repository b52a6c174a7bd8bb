#!/usr/bin/env python3
"""Where one program of the Gluon sparse attention (plugins/csa2_sparse_attention/gluon_batch.py)
spends its time: the kernel's source with clock stamps added, run at the released sizes (64 heads
x 512, 512 picks + the 128-key window per row, 128K entries per row, random picks), and the
stamps of one program (the median one by length) printed as a timeline.

    python3 scripts/attention_timeline.py --cases 16x1,16x4,64x1,128x1 [--keys 32 --stages 4] \
        [--out DIR]

A case is ROWSxSPLITS (query rows, key splits per row); --keys / --stages pick the kernel's key
blocks and stages (the launcher's GLUON_KB / GLUON_STAGES; default its own). The stamps are
%clock64 reads (SM cycles, converted at --clock-ghz) stored by every thread of the partition at
these points:

- per program: the kernel's start and end; the softmax partition's start, Q in shared memory, the
  first key block ready, its loop's end; the accumulating partition's start, its first
  gathers issued, the first p received, its loop's end, the result stored;
- per key block (the first 16): softmax side, the block ready / the logits done / p handed over;
  accumulating side, p and the block ready / p V done / the refill's copies issued.

The instrumented copy is made by inserting the stamps at fixed anchors of the kernel's source;
an anchor that is missing or not unique stops the script with its text (the kernel changed: update
ANCHORS). The stamps cost a few stores per point; the graph time of the instrumented kernel is
printed beside the plain kernel's so their cost shows. Session 35 found with it that the result's
store took 3.7 of a 27 us program (shared-memory bank conflicts; docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "plugins" / "csa2_sparse_attention" / "gluon_batch.py"
log = logging.getLogger("attention_timeline")

# per-program stamps (slot k of a program's 16) and per-block ticks (slot s of 6, block i < 16)
POINTS = ("softmax start", "Q in shared memory", "first block ready (softmax)", "softmax loop end",
          "accumulate start", "first gathers issued", "first p received", "accumulate loop end",
          "result stored", "kernel start", "kernel end")
TICKS = ("block ready (softmax)", "logits done", "p handed over", "p and block ready (accumulate)",
         "p V done", "refill issued")
TICK_BASE = 16 * 4096  # int64 slots before the ticks: room for 4096 programs' stamps
MAX_PROGRAMS = 4096

HELPERS = """
@gluon.jit
def _stamp(tb_ptr, part, k):
    c = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False,
                                  pack=1)
    gl.store(tb_ptr + part * 16 + k, c)


@gluon.jit
def _tick(tb_ptr, part, slot, i):
    if i < 16:
        c = gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False,
                                      pack=1)
        gl.store(tb_ptr + TICK_BASE + part * 96 + slot * 16 + i, c)


"""
I4, I8, I12 = " " * 4, " " * 8, " " * 12


def _lines(*lines: str) -> str:
    return "".join(f"{line}\n" for line in lines)


def _after(anchor: str, *lines: str) -> tuple[str, str]:
    """The anchor (whole lines), then `lines` (each with its indent) right after it."""
    return anchor, anchor + _lines(*lines)


def _before(anchor: str, *lines: str) -> tuple[str, str]:
    """`lines`, then the anchor (the start of a line)."""
    return anchor, _lines(*lines) + anchor


WAIT_P = f"{I8}mbarrier.wait(p_ready.index(pb), (i // 2) & 1)\n"
WAIT_KV = f"{I8}mbarrier.wait(kv_ready.index(s), (i // STAGES) & 1)\n"
# (anchor text in the kernel's source, the text it becomes); each anchor must occur exactly once
ANCHORS = (
    _before("@gluon.jit\ndef _block_keys(", HELPERS.replace("TICK_BASE", str(TICK_BASE))),
    ("def _softmax(q_ptr,", "def _softmax(tb_ptr, q_ptr,"),
    ("def _accumulate(q_ptr,", "def _accumulate(tb_ptr, q_ptr,"),
    ("def csa2_sparse_attention_ws_kernel(q_ptr,", "def csa2_sparse_attention_ws_kernel(tb_ptr, q_ptr,"),
    ("(_accumulate, (q_ptr,", "(_accumulate, (tb_ptr, q_ptr,"),
    ("(_softmax, (q_ptr,", "(_softmax, (tb_ptr, q_ptr,"),
    # the softmax partition
    _before(f"{I4}s_layout: gl.constexpr = gl.NVMMADistributedLayout(", f"{I4}_stamp(tb_ptr, part, 0)"),
    _before(f"{I4}h = gl.arange(0, H, layout=heads_l)\n", f"{I4}_stamp(tb_ptr, part, 1)"),
    _after(f"{WAIT_KV}{I8}fence_async_shared()\n{I8}kv = kv_smem.index(s)\n",
           f"{I8}_tick(tb_ptr, part, 0, i)", f"{I8}if i == 0:", f"{I12}_stamp(tb_ptr, part, 2)"),
    _after(f"{I8}logits, _, _ = warpgroup_mma_wait(0, deps=(logits, q_smem, kv))\n",
           f"{I8}_tick(tb_ptr, part, 1, i)"),
    _after(f"{I8}mbarrier.arrive(p_ready.index(pb), count=1)\n", f"{I8}_tick(tb_ptr, part, 2, i)",
           f"{I4}_stamp(tb_ptr, part, 3)"),
    # the accumulating partition
    _before(f"{I4}# the first blocks' addresses", f"{I4}_stamp(tb_ptr, part, 4)"),
    _after(f"{I4}acc = gl.zeros([H, D], gl.float32, layout=o_layout)\n", f"{I4}_stamp(tb_ptr, part, 5)"),
    (WAIT_P + WAIT_KV, WAIT_P + _lines(f"{I8}if i == 0:", f"{I12}_stamp(tb_ptr, part, 6)") + WAIT_KV
     + _lines(f"{I8}_tick(tb_ptr, part, 3, i)")),
    _after(f"{I8}mbarrier.arrive(p_empty.index(pb), count=1)\n", f"{I8}_tick(tb_ptr, part, 4, i)"),
    _after(f"{I12}_gather(src, valid, kv_smem.index(s), kv_ready.index(s), D, WARPS)\n",
           f"{I8}_tick(tb_ptr, part, 5, i)", f"{I4}_stamp(tb_ptr, part, 7)"),
    _after("out_ptr + row * H * D, kv_smem, H, D, WARPS)\n", f"{I4}_stamp(tb_ptr, part, 8)"),
    # the kernel
    _after(f"{I4}row = gl.program_id(0).to(gl.int64)\n",
           f"{I4}_stamp(tb_ptr, row * gl.num_programs(2) + gl.program_id(2), 9)"),
    _after(f"{I4}], [SOFTMAX_WARPS], [SOFTMAX_REGS])\n", f"{I4}_stamp(tb_ptr, part, 10)"),
)


def instrumented_source(source: str) -> str:
    """The kernel's source with the stamps: the kernel takes a leading int64 buffer tb_ptr of
    TICK_BASE + programs x 96 slots."""
    for anchor, replacement in ANCHORS:
        found = source.count(anchor)
        if found != 1:
            raise ValueError(f"anchor found {found} times (must be once; the kernel changed?): {anchor!r}")
        source = source.replace(anchor, replacement)
    return source


def load_instrumented(folder: Path):
    """Import the instrumented copy from a file in `folder` (Triton reads a kernel's source from
    its file)."""
    path = folder / "gluon_batch_timeline.py"
    path.write_text(instrumented_source(KERNEL.read_text()))
    spec = importlib.util.spec_from_file_location("gluon_batch_timeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for item in text.split(","):
        rows, _, splits = item.partition("x")
        if not (rows.isdigit() and splits.isdigit() and int(rows) > 0 and int(splits) > 0):
            raise ValueError(f"--cases: {item!r} is not ROWSxSPLITS (positive integers, e.g. 64x1)")
        if int(rows) * int(splits) > MAX_PROGRAMS:
            raise ValueError(f"--cases: {item!r} makes {int(rows) * int(splits)} programs; the stamp buffer "
                             f"holds {MAX_PROGRAMS}")
        cases.append((int(rows), int(splits)))
    return cases


def program_blocks(split: int, per: int, n_blocks: int) -> int:
    """How many of a row's n_blocks key blocks split number `split` runs, at `per` blocks a split
    (the kernel's n_iter)."""
    return max(0, min(per, n_blocks - split * per))


def block_steps(blocks_us: dict, stages: int = 2) -> dict:
    """Median step lengths in us over one program's key blocks (blocks_us: TICKS' times per block):
    the logits, the softmax, p's hand-over, p V, issuing the refill, the refill's copies landing
    (refill after block i issued -> block i + stages ready: with two stages, the two-stage cycle)
    and the period (one block ready to the next). None where the program has too few blocks for
    a step."""
    ready, logits, handed, acc_ready, pv, refill = (blocks_us[name] for name in TICKS)
    n = len(ready)

    def median(values):
        return round(statistics.median(values), 3) if values else None

    return {"logits": median([logits[i] - ready[i] for i in range(n)]),
            "softmax": median([handed[i] - logits[i] for i in range(n)]),
            "hand_over": median([acc_ready[i] - handed[i] for i in range(n)]),
            "p_v": median([pv[i] - acc_ready[i] for i in range(n)]),
            # the last `stages` blocks refill nothing
            "refill_issue": median([refill[i] - pv[i] for i in range(n - stages)]),
            "copies_land": median([ready[i + stages] - refill[i] for i in range(n - stages)]),
            "period": median([ready[i + 1] - ready[i] for i in range(n - 1)])}


def run_case(module, rows: int, n_split: int, ghz: float, gen, keys: int, stages: int) -> dict:
    import bench_kernels as bench
    import torch
    import triton.testing

    from dsflash.plugins.csa2_sparse_attention import gluon_batch, splits

    n, heads, dim, topk, window = 131072, bench.HEADS, bench.HEAD_DIM, bench.TOPK, bench.WINDOW

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=dtype)

    q, kv, win, sink = randn(rows, 1, heads, dim), randn(rows, n, dim), randn(rows, window, dim), \
        randn(heads, dtype=torch.float32)
    wmask = torch.ones(rows, 1, window, dtype=torch.uint8, device="cuda")
    idx = torch.randint(0, n, (rows, 1, topk), generator=gen, device="cuda")
    per, n_split = splits.split_plan(rows, topk, window, dim, keys, 2 * splits.H200_SMS, n_split)
    split, parts = n_split > 1, rows * n_split
    out = torch.empty_like(q)
    acc = torch.empty(parts * heads * dim, device="cuda")
    ml = torch.empty(parts * 2 * heads, device="cuda")
    stamps = torch.zeros(TICK_BASE + parts * 96, dtype=torch.int64, device="cuda")

    def launch(mod, *lead):
        mod.csa2_sparse_attention_ws_kernel[(rows, 1, n_split)](
            *lead, q, kv, idx, win, wmask, sink, 1, n, window, topk, per, acc if split else out, acc, ml,
            H=heads, D=dim, SCALE=dim ** -0.5, KB=keys, STAGES=stages, SPLIT=split, num_warps=8,
            maxnreg=mod.MAXNREG)

    times = {"plain_us": 1e3 * triton.testing.do_bench_cudagraph(lambda: launch(gluon_batch), rep=200),
             "stamped_us": 1e3 * triton.testing.do_bench_cudagraph(lambda: launch(module, stamps), rep=200)}
    torch.cuda.synchronize()
    prog = stamps[:parts * 16].view(parts, 16).double().cpu()
    ticks = stamps[TICK_BASE:].view(parts, 6, 16).double().cpu()
    length = prog[:, 10] - prog[:, 9]
    med = int(length.argsort()[parts // 2])
    origin = prog[med, 9]
    us = 1e-3 / ghz
    # the median program may be a row's last split, with fewer blocks than `per`: its later tick
    # slots were never written
    own = program_blocks(med % n_split, per, splits.key_blocks(topk, window, keys))
    blocks = {name: [round(float((t - origin) * us), 3) for t in ticks[med, k, :min(own, 16)]]
              for k, name in enumerate(TICKS)}
    return {"rows": rows, "splits": n_split, "keys": keys, "stages": stages, "blocks_per_program": per,
            **times, "program": med, "blocks": own,
            "points_us": {name: round(float((prog[med, k] - origin) * us), 3)
                          for k, name in enumerate(POINTS)},
            "blocks_us": blocks, "steps_us": block_steps(blocks, stages)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="16x1,16x4,32x2,64x1,128x1",
                    help="ROWSxSPLITS,... (default %(default)s)")
    ap.add_argument("--clock-ghz", type=float, default=1.98, help="SM clock for the cycle counts "
                    "(default %(default)s: H100 SXM / H200 boost)")
    ap.add_argument("--keys", type=int, default=None,
                    help="keys per block (GLUON_KB; default the launcher's)")
    ap.add_argument("--stages", type=int, default=None,
                    help="key stages (GLUON_STAGES; default the launcher's)")
    ap.add_argument("--out", type=Path, help="folder for attention_timeline.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        cases = parse_cases(args.cases)
    except ValueError as err:
        ap.error(str(err))
    if args.clock_ghz <= 0:
        ap.error(f"--clock-ghz {args.clock_ghz} must be positive")
    import torch

    from dsflash.plugins.csa2_sparse_attention import kernel as attn_kernel

    keys = attn_kernel.gluon_block_keys() if args.keys is None else args.keys
    stages = attn_kernel.GLUON_STAGES if args.stages is None else args.stages
    try:
        attn_kernel.check_gluon_blocks(64, 512, torch.bfloat16, keys, stages)
    except ValueError as err:
        ap.error(f"--keys {keys} --stages {stages}: {err}")

    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (an sm_90 one: the Gluon kernel is written for Hopper)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        module = load_instrumented(Path(tmp))
        for rows, n_split in cases:
            res = run_case(module, rows, n_split, args.clock_ghz, gen, keys, stages)
            results.append(res)
            log.info("%d rows x %d splits (%d blocks of %d keys per program, %d stages): %.1f us plain, "
                     "%.1f us stamped; program %d:", rows, res["splits"], res["blocks_per_program"], keys,
                     stages, res["plain_us"], res["stamped_us"], res["program"])
            for name, t in res["points_us"].items():
                log.info("  %-32s %8.2f us", name, t)
            for name, ts in res["blocks_us"].items():
                log.info("  %-32s %s", name, " ".join(f"{t:6.2f}" for t in ts))
            log.info("  median steps (us): %s", ", ".join(f"{k} {v}" for k, v in res["steps_us"].items()))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "attention_timeline.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "clock_ghz": args.clock_ghz, "cases": results},
            indent=1))


if __name__ == "__main__":
    sys.exit(main())
