#!/usr/bin/env python3
"""Build a seeded reference model, prefill a prompt, greedy-decode N tokens; print tokens and timings.

    python scripts/demo.py --config tiny --tokens 32
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from dsflash.model.cache import ModelCache
from dsflash.model.config import ModelConfig
from dsflash.model.model import DSFlashModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--prompt-len", type=int, default=21)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--mode", default="replay", choices=["replay", "exact"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log = logging.getLogger("demo")

    cfg = ModelConfig.preset(args.config)
    t0 = time.perf_counter()
    model = DSFlashModel(cfg).init_weights(args.seed).eval()
    log.info("built %s model (%.1fM parameters) in %.2f s", args.config,
             sum(p.numel() for p in model.parameters()) / 1e6, time.perf_counter() - t0)
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=gen)
    cache = ModelCache.allocate(cfg, 1, args.prompt_len + args.tokens)
    t0 = time.perf_counter()
    logits = model.prefill(prompt, cache, mode=args.mode)
    t_prefill = time.perf_counter() - t0
    tokens, t0 = [], time.perf_counter()
    for i in range(args.tokens):
        tok = logits.argmax(-1)
        tokens.append(int(tok))
        if i + 1 < args.tokens:
            logits = model.decoder_step(tok.view(1, 1), cache)
    t_decode = time.perf_counter() - t0
    print("prompt:", prompt[0].tolist())
    print("tokens:", tokens)
    print(f"prefill ({args.mode}, {args.prompt_len} tokens): {t_prefill * 1e3:.1f} ms; "
          f"decode: {t_decode / max(args.tokens - 1, 1) * 1e3:.1f} ms/token "
          f"({(args.tokens - 1) / t_decode:.1f} tokens/s)")


if __name__ == "__main__":
    main()
