#!/usr/bin/env python3
"""Export a model to a bundle: encoder_prefill and decoder_step in the plugin and/or portable
flavor, one shared weights file, config.json and manifest.json.

    python scripts/export.py --config tiny --out engines/tiny [--flavor both] [--checkpoint w.safetensors]

--decode-attention single exports decoder_step's attention as one plugin node instead of the split
pair, for engines that serve large decode batches; --decode-moe gathered has decoder_step read
only each row's routed experts, for small decode batches (see their help).

With --structure, the graphs only (built on the meta device, no weights), each checked against
the state contract: for sizes whose weights do not fit here, the `flash` preset's included
(about 2 min per plugin graph and 5 per portable decode step on a 2-core CPU):

    python scripts/export.py --config flash --structure --out engines/flash-structure
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from dsflash.export.bundle import write_bundle
from dsflash.export.contract import GRAPHS
from dsflash.export.onnx_export import DECODE_ATTENTION_FORMS, DECODE_MOE_FORMS
from dsflash.export.structure import StructureReport, write_structures
from dsflash.model.config import ModelConfig
from dsflash.model.model import DSFlashModel
from dsflash.model.weights import load_safetensors

log = logging.getLogger("export")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", choices=["tiny", "small", "flash"],
                    help="preset (flash: --structure only)")
    ap.add_argument("--structure", action="store_true",
                    help="graphs without weights, checked against the contract (no bundle)")
    ap.add_argument("--graph", default="both", choices=["encoder_prefill", "decoder_step", "both"],
                    help="with --structure: which graphs")
    ap.add_argument("--out", required=True, help="bundle folder, e.g. engines/tiny")
    ap.add_argument("--flavor", default="both", choices=["plugin", "portable", "both"])
    ap.add_argument("--checkpoint", help="safetensors weights (default: seeded random weights)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the graphs' weights, activations and model-dtype state (bfloat16 bundles "
                         "run on ort-cuda, trt or torch; ONNX Runtime's CPU provider lacks bf16 kernels)")
    ap.add_argument("--workers", type=int, default=2, help="export processes (one graph each)")
    ap.add_argument("--decode-attention", default="split", choices=DECODE_ATTENTION_FORMS,
                    help="decoder_step's attention in the plugin flavor: split (two nodes, the keys of a "
                         "decode row spread over the GPU; best up to ~32 rows per step) or single (one "
                         "node; best from ~48 rows: H100, batch 64 29.4 against 36.2 us, 128 44.8 "
                         "against 59.1; one row 27.0 against 7.9)")
    ap.add_argument("--decode-moe", default="dense", choices=DECODE_MOE_FORMS,
                    help="decoder_step's routed experts: dense (every expert on every row, weight 0 "
                         "where not routed) or gathered (each row's k experts gathered from the "
                         "stacks: fewer bytes below E / 3k rows, flash 21; holds rows x k x 3 expert "
                         "matrices, flash bf16 425 MB a row). encoder_prefill stays dense")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("torch", "onnxscript", "onnx_ir"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    cfg = ModelConfig.preset(args.config)
    flavors = ("plugin", "portable") if args.flavor == "both" else (args.flavor,)
    if args.structure:
        _structures(cfg, args, flavors)
        return
    if args.config == "flash":
        ap.error("--config flash needs --structure: its weights (748 B parameters) do not fit here")
    model = DSFlashModel(cfg).eval()
    if args.checkpoint:
        load_safetensors(model, args.checkpoint)
    else:
        model.init_weights(args.seed)
    model = model.to(getattr(torch, args.dtype))
    t0 = time.time()
    steps = iter(range(1, 2 * len(flavors) + 1))
    bundle = write_bundle(model, args.out, args.config, flavors, workers=args.workers,
                          decode_attention=args.decode_attention, decode_moe=args.decode_moe,
                          progress=lambda msg: log.info("[%d/%d] %s", next(steps), 2 * len(flavors), msg))
    print(f"bundle {bundle.path}: {', '.join(sorted(bundle.manifest['files']))} "
          f"({time.time() - t0:.0f} s)")


def _structures(cfg: ModelConfig, args, flavors: tuple[str, ...]) -> None:
    def report(r: StructureReport) -> None:
        log.info("%s (%s): %d nodes in %.0f s", r.graph, r.flavor, r.nodes, r.seconds)

    graphs = GRAPHS if args.graph == "both" else (args.graph,)
    reports = write_structures(cfg, args.out, flavors, graphs, workers=args.workers, progress=report,
                               decode_attention=args.decode_attention, decode_moe=args.decode_moe)
    print(f"{'graph':<16} {'flavor':<9} {'nodes':>7} {'s':>5}  plugin nodes")
    for r in reports:
        custom = ", ".join(f"{k} {v}" for k, v in sorted(r.custom_nodes.items())) or "-"
        print(f"{r.graph:<16} {r.flavor:<9} {r.nodes:>7} {r.seconds:>5.0f}  {custom}")
    print(f"structures in {args.out}: I/O of every graph equals the state contract")


if __name__ == "__main__":
    main()
