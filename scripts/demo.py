#!/usr/bin/env python3
"""The main job, end to end on the CPU: build the seeded tiny model, export it to a bundle,
run the ONNX Runtime graphs on a prompt (replay prefill + greedy decode) and show that the
tokens equal the PyTorch reference's. Prints tokens and timings; exits non-zero on a mismatch.

    python scripts/demo.py [--config tiny] [--tokens 32] [--bundle engines/tiny] [--flavor portable]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from dsflash.export.bundle import Bundle, write_bundle
from dsflash.export.ort_greedy import OrtGraphs
from dsflash.model.config import ModelConfig
from dsflash.model.generate import generate
from dsflash.model.model import DSFlashModel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--bundle", type=Path, default=Path("engines/tiny"))
    ap.add_argument("--flavor", default="portable", choices=["portable", "plugin", "both"])
    ap.add_argument("--reuse", action="store_true", help="use an existing bundle instead of exporting")
    ap.add_argument("--prompt-len", type=int, default=21)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("torch", "onnxscript", "onnx_ir"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    log = logging.getLogger("demo")

    cfg = ModelConfig.preset(args.config)
    model = DSFlashModel(cfg).init_weights(args.seed).eval()
    flavors = ("portable", "plugin") if args.flavor == "both" else (args.flavor,)
    t0 = time.perf_counter()
    if args.reuse:
        bundle = Bundle.open(args.bundle)
    else:
        bundle = write_bundle(model, args.bundle, args.config, flavors, workers=2,
                              progress=lambda msg: log.info(msg))
    log.info("bundle %s ready in %.1f s", bundle.path, time.perf_counter() - t0)

    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
    t0 = time.perf_counter()
    expected = generate(model, [prompt], args.tokens)[0]
    t_torch = time.perf_counter() - t0
    print("prompt:          ", prompt)
    print("pytorch tokens:  ", expected)
    ok = True
    for flavor in flavors:
        graphs = OrtGraphs(bundle, flavor)
        t0 = time.perf_counter()
        tokens = graphs.greedy(prompt, args.tokens)
        t_ort = time.perf_counter() - t0
        same = tokens == expected
        ok &= same
        print(f"onnxruntime ({flavor}):", tokens)
        print(f"  {'EQUAL to' if same else 'DIFFERENT from'} PyTorch; {args.tokens} tokens in "
              f"{t_ort:.2f} s on ONNX Runtime ({args.tokens / t_ort:.1f} tokens/s), "
              f"{t_torch:.2f} s in PyTorch eager")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
