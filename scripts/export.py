#!/usr/bin/env python3
"""Export a model to a bundle: encoder_prefill and decoder_step in the plugin and/or portable
flavor, one shared weights file, config.json and manifest.json.

    python scripts/export.py --config tiny --out engines/tiny [--flavor both] [--checkpoint w.safetensors]
"""

from __future__ import annotations

import argparse
import logging
import time

from dsflash.export.bundle import write_bundle
from dsflash.model.config import ModelConfig
from dsflash.model.model import DSFlashModel
from dsflash.model.weights import load_safetensors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--out", required=True, help="bundle folder, e.g. engines/tiny")
    ap.add_argument("--flavor", default="both", choices=["plugin", "portable", "both"])
    ap.add_argument("--checkpoint", help="safetensors weights (default: seeded random weights)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="export processes (one graph each)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("torch", "onnxscript", "onnx_ir"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    cfg = ModelConfig.preset(args.config)
    model = DSFlashModel(cfg).eval()
    if args.checkpoint:
        load_safetensors(model, args.checkpoint)
    else:
        model.init_weights(args.seed)
    flavors = ("plugin", "portable") if args.flavor == "both" else (args.flavor,)
    t0 = time.time()
    steps = iter(range(1, 2 * len(flavors) + 1))
    bundle = write_bundle(model, args.out, args.config, flavors, workers=args.workers,
                          progress=lambda msg: logging.info("[%d/%d] %s", next(steps), 2 * len(flavors), msg))
    print(f"bundle {bundle.path}: {', '.join(sorted(bundle.manifest['files']))} "
          f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
