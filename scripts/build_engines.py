#!/usr/bin/env python3
"""Build TensorRT plans for a bundle's plugin-flavor graphs (needs the full TensorRT builder and
a GPU; the preflight runs anywhere and names any custom node without a plugin).

    python scripts/build_engines.py --bundle engines/tiny --max-batch 8 --capacity 4096 \
        --max-prompt 512 --max-step 1 [--opt-batch 4] [--preflight-only]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("build_engines")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--opt-batch", type=int, default=None,
                    help="the batch TensorRT picks each plugin's tactics at (default --max-batch): the "
                         "batch the deployment serves most")
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--max-prompt", type=int, default=512, help="rows of one prefill chunk (encoder_prefill)")
    ap.add_argument("--max-step", type=int, default=1, help="rows of one decoder_step (1, or W for replay)")
    ap.add_argument("--preflight-only", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    import onnx

    from dsflash.export.bundle import Bundle
    from dsflash.export.trt_build import (
        build_plan,
        decode_attention_advice,
        decode_moe_advice,
        optimization_profiles,
        preflight,
    )

    bundle = Bundle.open(args.bundle)
    for graph in ("encoder_prefill", "decoder_step"):
        ops = preflight(onnx.load(str(bundle.graph_path(graph, "plugin")), load_external_data=False))
        log.info("%s: plugins %s", graph, ", ".join(ops))
    opt_rows = args.opt_batch or args.max_batch  # a decode step: one row per sequence
    advice = decode_attention_advice(bundle, opt_rows)
    if advice:
        log.warning(advice)
    for line in decode_moe_advice(bundle, opt_rows, args.max_batch * args.max_step):
        log.warning(line)
    if args.preflight_only:
        return 0
    rows = {"encoder_prefill": args.max_prompt, "decoder_step": args.max_step}
    cache = Path(args.bundle) / "plans" / "timing.cache"
    cache.parent.mkdir(exist_ok=True)
    for graph in tqdm(rows, desc="plans"):
        prof = optimization_profiles(bundle, graph, args.max_batch, args.capacity, rows[graph],
                                     args.opt_batch)
        log.info("built %s", build_plan(bundle, graph, prof, timing_cache=cache))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
