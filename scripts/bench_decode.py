#!/usr/bin/env python3
"""A whole decode step through the runtime (PIPELINE.md §8): the cache manager's feeds, the
decoder_step engine, the cache write and the greedy rows' token ids to the host (select_tokens;
--host-logits: every row's logits, as the generator copied them before session 40), as the
generator runs them, for a model with random weights over a synthetic cache of `context` tokens
per sequence.

Modes (each after a warm-up, on the same state; the first step's logits are compared):
  reference      reference ops, eager (the spec)
  triton         the Triton kernels, eager
  graph-copy     the kernels in a CUDA graph fed a gathered copy of the state (the runtime before
                 the in-place cache: every step copied each sequence's whole cache twice, into
                 the gathered feeds and into the graph's own buffers)
  graph          the kernels in a CUDA graph that reads the cache pools in place
  graph-mask     the same with the Reindex layers over the candidate pool as a mask over every
                 entry (OpSet pool_form "mask", the graphs' form) instead of the listed pool the
                 Triton backend uses (session 20): the whole step's A/B of that change
  compiled       the same, with the step compiled by torch.compile (inductor) first: the PyTorch
                 ops between the kernels fused (TorchEngine(compile="inductor"))
  compiled-autotune  compiled, inductor choosing each matmul among its Triton templates and
                 cuBLAS by timing them (max_autotune_gemm; a longer compile)
  compiled-cdt   compiled with engine.TUNED_COMPILE: inductor's own kernels' block sizes tuned
                 by timing (coordinate_descent_tuning), which also lowers one-row matmuls to
                 reductions fused with their neighbours (a longer compile)
  compiled-tuned  both settings

Prints ms per step, tokens/s, the last mode's ratio to each other mode, and the roofline
fraction: the bytes a step must read (weights once, the cache it attends to;
model.accounting.decode_step_bytes) over the device copy bandwidth measured in the same run.

    python3 scripts/bench_decode.py --out gpu_out [--config small] [--batches 1,8,32]
        [--contexts 4096,130048] [--steps 12] [--modes reference,triton,graph-copy,graph-mask,graph,compiled]
    python scripts/bench_decode.py --device cpu --config tiny --contexts 48 --batches 2 \
        --modes reference --steps 2 --out /tmp/decode   # the plumbing, on a CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from dsflash.model.accounting import decode_step_bytes
from dsflash.model.config import ModelConfig
from dsflash.model.model import DSFlashModel
from dsflash.model.sampling import SamplingParams, select_tokens
from dsflash.runtime.cache_manager import CacheManager, synthetic_cache
from dsflash.runtime.engine import TUNED_COMPILE, TorchEngine

# inductor settings of each compiled mode (TorchEngine's compile_options)
COMPILED = {"compiled": None, "compiled-autotune": {"max_autotune_gemm": True},
            "compiled-cdt": TUNED_COMPILE, "compiled-tuned": {**TUNED_COMPILE, "max_autotune_gemm": True}}
MODES = ("reference", "triton", "graph-copy", "graph", *COMPILED, "graph-mask")
GRAPHED = ("graph-copy", "graph", *COMPILED, "graph-mask")
# the default run: every eager and graphed form, then the compiled step (the ratios' base)
DEFAULT_MODES = ("reference", "triton", "graph-copy", "graph-mask", "graph", "compiled")
log = logging.getLogger("bench_decode")


def copy_bandwidth_GBps(device: str) -> float:
    """Read + write bytes per second of a 1 GB device copy (median of 20), the roofline's rate."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * 2 / statistics.median(times) / 1e9


def engine_for(model, mode: str, kept: dict | None = None) -> TorchEngine:
    """A fresh engine per case, except compiled ones, which are kept in `kept` across cases: a
    new torch.compile wrapper would compile again (the runtime, too, keeps one engine)."""
    # the shared OpSet's pool form as this mode runs it (a graph captures it at its first step)
    model.ops.pool_form = "mask" if mode == "graph-mask" else "auto"
    if kept is not None and mode in kept:
        model.ops.backend = "triton"  # another mode's engine may have switched the shared OpSet
        return kept[mode]
    ops = "reference" if mode == "reference" else "triton"
    engine = TorchEngine(model, "decoder_step", ops=ops, cuda_graph=mode in GRAPHED,
                         compile="inductor" if mode in COMPILED else None,
                         compile_options=COMPILED.get(mode))
    if kept is not None and mode in COMPILED:
        kept[mode] = engine
    return engine


def run_steps(engine: TorchEngine, cm: CacheManager, mode: str, ids_list: list,
              host_logits: bool = False) -> tuple[list, torch.Tensor]:
    """Decode steps as the generator makes them, greedy rows (their ids to the host; with
    `host_logits`, every row's logits, as the generator did before session 40); seconds per step
    and the first step's logits (copied outside the timing)."""
    slots = list(range(cm.slots))
    names = engine.input_names
    greedy = [SamplingParams()] * len(slots)
    times, first = [], None
    for ids in ids_list:
        t0 = time.perf_counter()
        if mode == "graph-copy":
            state = cm.cache.gather(cm.cache.slot_index(slots))
            feeds, resident = {n: (ids.to(state["seq_len"].device) if n == "ids" else state[n])
                               for n in names}, ()
        else:
            feeds, resident = cm.feeds(slots, names, ids), names[1:]
        out = engine.run(feeds, resident=resident)
        cm.write("decoder_step", slots, out, feeds["seq_len"])
        if host_logits:
            out["logits"].float().cpu()
        else:
            select_tokens(out["logits"], greedy, [None] * len(slots))
        times.append(time.perf_counter() - t0)
        first = out["logits"].float().cpu() if first is None else first
    return times, first


def bench_case(model, cfg, batch: int, context: int, args, bw: float, kept: dict) -> dict:
    warm, steps = args.warmup, args.steps
    cm = synthetic_cache(cfg, batch, context, warm + steps, args.device, model.embed.weight.dtype,
                         args.seed)
    snapshot = {k: v.clone() for k, v in cm.cache.tensors.items()}
    gen = torch.Generator().manual_seed(args.seed + 1)
    ids_list = [torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen) for _ in range(warm + steps)]
    need = decode_step_bytes(model, cfg, batch, context)
    res = {"batch": batch, "context": context, "bytes": need, "modes": {}}
    logits = {}
    for mode in args.modes:
        for k, v in cm.cache.tensors.items():
            v.copy_(snapshot[k])
        cm.sync_lengths()
        engine = engine_for(model, mode, kept)
        times, logits[mode] = run_steps(engine, cm, mode, ids_list, args.host_logits)
        ms = statistics.median(times[warm:]) * 1e3
        roof_ms = (need["weights"] + need["cache"]) / (bw * 1e9) * 1e3
        # the first step captures a graph (and compiles, for a new shape): seconds, apart
        res["modes"][mode] = {"ms": ms, "tokens_per_s": batch / ms * 1e3, "roofline": roof_ms / ms,
                              "first_step_s": times[0]}
        del engine
    base = args.modes[-1]
    for mode, lg in logits.items():
        res["modes"][mode]["max_abs_logit_diff_vs_" + base] = float((lg - logits[base]).abs().max())
        same_argmax = torch.equal(lg.argmax(-1), logits[base].argmax(-1))
        res["modes"][mode]["argmax_agrees_" + base] = bool(same_argmax)
    copied, in_place = logits.get("graph-copy"), logits.get("graph")
    if copied is not None and in_place is not None and not torch.equal(copied, in_place):
        raise AssertionError(f"batch {batch} context {context}: the in-place graph's logits differ "
                             "from the copying graph's (they run the same kernels on the same state)")
    return res


def profile_graph_step(model, cfg, batch: int, context: int, args, mode: str, kept: dict,
                       rows: int = 25) -> str:
    """The GPU kernels of one graphed decode step (torch.profiler over 3 steps): launches per
    step and the kernels that take the most time, to see where a step goes."""
    from torch.profiler import ProfilerActivity, profile

    cm = synthetic_cache(cfg, batch, context, 8, args.device, model.embed.weight.dtype, args.seed)
    engine = engine_for(model, mode, kept)
    ids = [torch.zeros(batch, 1, dtype=torch.int64)] * 3
    run_steps(engine, cm, mode, ids)  # capture (and compile) outside the profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_steps(engine, cm, mode, ids)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    launches = sum(e.count for e in events) / len(ids)
    total = sum(e.device_time_total for e in events) / len(ids)
    head = f"{mode} step, batch {batch}, context {context}: {launches:.0f} kernels, {total / 1e3:.2f} ms"
    lines = [head + " of kernel time per step", "| kernel | per step | us per step |", "|---|---:|---:|"]
    lines += [f"| {e.key[:90]} | {e.count / len(ids):.0f} | {e.device_time_total / len(ids):.1f} |"
              for e in events[:rows]]
    return "\n".join(lines)


def token_select_ms(batch: int, vocab: int, device: str, seed: int, reps: int = 20) -> dict:
    """Milliseconds (median of `reps`) to pick a decode batch's tokens from bf16 logits of `vocab`
    on the device: every row's logits to the host in fp32 (the generator before session 40),
    select_tokens for greedy rows (ids only), and for seeded top-k sampled rows (their logits
    to the host)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=gen).to(device, torch.bfloat16)
    sampled = SamplingParams(temperature=0.8, top_k=50)
    ways = {"host_logits": lambda: logits.float().cpu(),
            "greedy_ids": lambda: select_tokens(logits, [SamplingParams()] * batch, [None] * batch),
            "sampled_rows": lambda: select_tokens(logits, [sampled] * batch,
                                                  [torch.Generator().manual_seed(i) for i in range(batch)])}
    on_host = logits.float().cpu()
    if ways["greedy_ids"]() != on_host.argmax(-1).tolist():
        raise AssertionError(f"batch {batch}: select_tokens' greedy ids on {device} differ from the "
                             "argmax of the logits copied to the host")
    res = {}
    for name, way in ways.items():
        way()  # warm-up
        times = []
        for _ in range(reps):
            if device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            way()  # each returns host values: the copy waits for the device
            times.append(time.perf_counter() - t0)
        res[name] = 1e3 * statistics.median(times)
    return res


def table(results: list, modes: list, bw: float) -> str:
    last, others = modes[-1], modes[:-1]
    head = f"| batch | context | {' | '.join(f'{m} ms' for m in modes)} | {last} tok/s | "
    head += "".join(f"x {m} | " for m in others) + "roofline |"
    lines = [f"copy bandwidth {bw:.0f} GB/s", head, "|" + "---:|" * (head.count("|") - 1)]
    for r in results:
        ms = r["modes"]
        best = ms[last]
        ratios = "".join(f"{ms[m]['ms'] / best['ms']:.2f}x | " for m in others)
        lines.append(f"| {r['batch']} | {r['context']} | " + " | ".join(f"{ms[m]['ms']:.2f}" for m in modes)
                     + f" | {best['tokens_per_s']:.0f} | {ratios}{best['roofline']:.0%} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="small", choices=["tiny", "small"])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="4096,130048")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"of {MODES}")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--kv-qat", action="store_true",
                    help="the flash preset's FP8/FP4 round-trips, index keys stored in FP4")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--select-vocab", type=int, default=129280,
                    help="also time picking each batch's tokens from logits of this vocab (flash's by "
                         "default): every row's logits to the host against select_tokens; 0: skip")
    ap.add_argument("--host-logits", action="store_true",
                    help="time every row's logits copied to the host (the generator before session 40) "
                         "instead of the greedy rows' ids")
    ap.add_argument("--profile", action="store_true",
                    help="also list the kernels of one graph / compiled step (first batch and context)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.modes = args.modes.split(",")
    bad = [m for m in args.modes if m not in MODES]
    if bad or (args.device == "cpu" and any(m in GRAPHED for m in args.modes)):
        ap.error(f"modes {args.modes}: known {MODES}; CUDA graphs need --device cuda")
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be >= 1")
    cfg = ModelConfig.preset(args.config).replace(kv_qat=args.kv_qat)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = DSFlashModel(cfg).init_weights(seed=args.seed).eval().to(args.device, dtype)
    bw = copy_bandwidth_GBps(args.device)
    cases = [(int(b), int(c)) for c in args.contexts.split(",") for b in args.batches.split(",")]
    kept: dict = {}
    results = [bench_case(model, cfg, b, c, args, bw, kept) for b, c in tqdm(cases, desc="decode cases")]
    selects = {}
    if args.select_vocab > 0:
        for b in sorted({b for b, _ in cases}):
            selects[b] = token_select_ms(b, args.select_vocab, args.device, args.seed)
            log.info("token selection, batch %d, vocab %d: %s", b, args.select_vocab,
                     ", ".join(f"{k} {v:.3f} ms" for k, v in selects[b].items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": args.config, "kv_qat": args.kv_qat,
            "dtype": args.dtype, "device": args.device, "copy_GBps": bw,
            "warmup": args.warmup, "steps": args.steps, "modes": args.modes, "host_logits": args.host_logits,
            "gpu": torch.cuda.get_device_name() if args.device != "cpu" else "cpu"}
    meta["select_vocab"] = args.select_vocab
    (out / "bench_decode.json").write_text(json.dumps({"meta": meta, "results": results,
                                                       "token_select_ms": selects}, indent=1))
    log.info("%s", table(results, args.modes, bw))
    if args.profile:
        reports = [profile_graph_step(model, cfg, *cases[0], args, mode, kept)
                   for mode in ("graph", *COMPILED) if mode in args.modes]
        (out / "bench_decode_profile.md").write_text("\n\n".join(reports) + "\n")
        log.info("%s", "\n\n".join(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
