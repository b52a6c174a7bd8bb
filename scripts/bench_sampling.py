#!/usr/bin/env python3
"""Host time of sampling one token from a row of logits (model/sampling.py), per row, against
in-run baselines:

- fast: `sample_next` (top-k through torch.topk, top-p sorting only the nucleus' binades, one
  uniform per draw);
- spec: `candidates_reference` (sorts the whole vocabulary) and the same draw;
- former: the sampler of sessions 1-40 (top-k mask, a whole-vocabulary sort for top-p,
  torch.multinomial: one exponential per token);
- one pass: `row.max()`, the floor of anything that reads the row once.

Rows are N(0, 1) x scale at the vocabulary (flash: 129,280): scale 6 gives a peaked row (a top-p
0.9 nucleus of ~20 tokens), 4 a middling one (~600), 3 a flat one (~6,000). Then a decode
batch through `select_tokens` from bf16 logits on the GPU (when there is one): the copy of the
sampled rows to the host and their sampling. Every timed row's fast candidates are checked
against the spec's. Prints a table; writes bench_sampling.json.

    python scripts/bench_sampling.py --out gpu_out
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

from dsflash.model.sampling import (
    SamplingParams,
    candidates,
    candidates_reference,
    draw,
    sample_next,
    select_tokens,
)

log = logging.getLogger("bench_sampling")

KINDS = {"top-k 50": SamplingParams(temperature=0.8, top_k=50),
         "top-p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
         "top-k 50 + top-p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
         "temperature 1": SamplingParams(temperature=1.0)}
SCALES = {"peaked": 6.0, "middling": 4.0, "flat": 3.0}


def former_sample(row_V: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The sampler as it was up to 2026-12-06 (the in-run baseline; its seeded tokens differ)."""
    scores = row_V.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = torch.softmax(sorted_scores, dim=0)
        sorted_scores = sorted_scores.masked_fill((probs.cumsum(0) - probs) >= params.top_p, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(0, order, sorted_scores)
    return int(torch.multinomial(torch.softmax(scores, dim=0), 1, generator=generator))


def same_candidates(a: tuple, b: tuple) -> bool:
    """The same ids with the same probabilities, in whichever order each lists them."""
    (ids_a, probs_a), (ids_b, probs_b) = a, b
    order_a, order_b = torch.argsort(ids_a), torch.argsort(ids_b)
    return torch.equal(ids_a[order_a], ids_b[order_b]) and torch.equal(probs_a[order_a], probs_b[order_b])


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def per_row(vocab: int, reps: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    res = []
    for shape, scale in tqdm(SCALES.items(), desc="row shapes"):
        row = torch.randn(vocab, generator=gen) * scale
        for kind, params in KINDS.items():
            fast, spec = candidates(row, params), candidates_reference(row, params)
            if not same_candidates(fast, spec):
                raise AssertionError(f"{shape} row, {kind}: candidates differ from candidates_reference")
            g = torch.Generator().manual_seed(seed)
            one = row[None]
            res.append({"shape": shape, "kind": kind, "candidates": int(fast[0].numel()),
                        "fast_ms": median_ms(lambda: sample_next(one, params, g), reps),
                        "spec_ms": median_ms(lambda: draw(candidates_reference(row, params)[1], g), reps),
                        "former_ms": median_ms(lambda: former_sample(row, params, g), reps),
                        "one_pass_ms": median_ms(lambda: row.max(), reps)})
    return res


def batch_select(vocab: int, batches: list[int], reps: int, seed: int, device: str) -> list[dict]:
    """select_tokens over a decode batch of sampled (top-k 50) rows of bf16 logits on device."""
    gen = torch.Generator().manual_seed(seed)
    res = []
    for batch in batches:
        logits = (torch.randn(batch, vocab, generator=gen) * SCALES["middling"]).to(device, torch.bfloat16)
        params = [KINDS["top-k 50"]] * batch
        gens = [torch.Generator().manual_seed(i) for i in range(batch)]
        ms = median_ms(lambda: select_tokens(logits, params, gens), reps)
        res.append({"batch": batch, "device": device, "select_ms": ms, "per_row_ms": ms / batch})
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--vocab", type=int, default=129_280)
    ap.add_argument("--batches", default="1,32,64", help="decode batches for select_tokens")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    sizes = [int(b) for b in args.batches.split(",")]
    if args.vocab < 2 or min(sizes) < 1 or args.reps < 1:
        ap.error(f"--vocab {args.vocab} must be >= 2, --batches {args.batches} >= 1 each, "
                 f"--reps {args.reps} >= 1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = per_row(args.vocab, args.reps, args.seed)
    batches = batch_select(args.vocab, sizes, args.reps, args.seed, device)
    meta = {"vocab": args.vocab, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    args.out.mkdir(parents=True, exist_ok=True)
    res = {"meta": meta, "rows": rows, "batches": batches}
    (args.out / "bench_sampling.json").write_text(json.dumps(res, indent=1))
    lines = [f"one row, vocab {args.vocab}, {meta['threads']} threads: ms per row (median of {args.reps})",
             "| row | sampling | candidates | fast | spec (sort) | former | former / fast "
             "| fast / one pass |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['shape']} | {r['kind']} | {r['candidates']} | {r['fast_ms']:.2f} | "
              f"{r['spec_ms']:.2f} | "
              f"{r['former_ms']:.2f} | {r['former_ms'] / r['fast_ms']:.1f}x | "
              f"{r['fast_ms'] / r['one_pass_ms']:.0f} |" for r in rows]
    lines += ["", f"select_tokens, top-k 50 rows of bf16 logits on {meta['device']}:",
              "| batch | ms | ms per row |", "|---:|---:|---:|"]
    lines += [f"| {b['batch']} | {b['select_ms']:.2f} | {b['per_row_ms']:.2f} |" for b in batches]
    log.info("\n%s", "\n".join(lines))


if __name__ == "__main__":
    main()
