#!/usr/bin/env python3
"""Generate from a bundle with the runtime: continuous batching over the two graphs.

    python scripts/generate.py --bundle engines/tiny --backend ort --prompt "hello" [--stream]
    python scripts/generate.py --bundle engines/tiny --prompts-file prompts.txt --max-new-tokens 64
    python scripts/generate.py --bundle engines/tiny --backend torch-compiled --tuned-compile ... (GPU)
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from dsflash.export.bundle import BundleError
from dsflash.model.model import PREFILL_MODES
from dsflash.model.sampling import SamplingParams
from dsflash.runtime.api import Runtime
from dsflash.runtime.engine import BACKENDS, TUNED_COMPILE
from dsflash.runtime.request import GenerationParams

log = logging.getLogger("generate")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--backend", default="ort", choices=BACKENDS)
    ap.add_argument("--prompt", action="append", default=[])
    ap.add_argument("--prompts-file")
    ap.add_argument("--tokenizer", help="tokenizer.json (default: byte-level)")
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=512)
    ap.add_argument("--prefill", default="replay", choices=PREFILL_MODES)
    ap.add_argument("--tuned-compile", action="store_true",
                    help="torch-compiled: tune inductor's kernels by timing (TUNED_COMPILE: a faster "
                         "decode step for about twice the compile time)")
    ap.add_argument("--warm-up", action="store_true",
                    help="compile and capture every decode batch size and the prompts' prefills "
                         "before generating (Runtime.warm_up), so the timings are serving speed")
    args = ap.parse_args()
    if args.tuned_compile and args.backend != "torch-compiled":
        ap.error(f"--tuned-compile is for --backend torch-compiled, not {args.backend}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        ap.error("give --prompt or --prompts-file")
    try:
        return serve(args, prompts)
    except (BundleError, ValueError, TypeError) as err:
        # what the library raises for a bad bundle or request names the value and the limit: say
        # that line, not a traceback (an error inside a backend is none of these and keeps its own)
        ap.exit(2, f"{ap.prog}: error: {err}\n")


def serve(args, prompts: list[str]) -> int:
    rt = Runtime.from_bundle(args.bundle, backend=args.backend, slots=args.slots,
                             capacity=args.capacity, tokenizer=args.tokenizer,
                             compile_options=TUNED_COMPILE if args.tuned_compile else None)
    params = GenerationParams(
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed),
        max_new_tokens=args.max_new_tokens, prefill_mode=args.prefill)
    if args.warm_up:
        lengths = sorted({len(rt.tokenizer.encode(p)) for p in prompts})
        seconds = rt.warm_up(prompt_lengths=lengths, prefill_mode=args.prefill)
        log.info("warm-up: %.1f s (%s)", sum(seconds.values()),
                 ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items()))
    t0 = time.perf_counter()
    if args.stream:
        for prompt in prompts:
            n, start = 0, time.perf_counter()
            for event in rt.stream(prompt, params):
                sys.stdout.write(event.text or f"[{event.token}]")
                sys.stdout.flush()
                n += 1
            print(f"\n({n} tokens, {n / (time.perf_counter() - start):.1f} tokens/s)")
        return 0
    requests = rt.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    total = sum(len(r.tokens) for r in requests)
    for r in requests:
        print(f"[{r.request_id}] {r.text!r} tokens={r.tokens} finish={r.finish_reason} "
              f"ttft={r.time_to_first_token * 1e3:.1f} ms"
              + (f" tpot={r.time_per_output_token * 1e3:.1f} ms" if r.time_per_output_token else ""))
    print(f"{total} tokens in {elapsed:.2f} s: {total / elapsed:.1f} tokens/s ({args.backend})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
