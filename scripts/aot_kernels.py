#!/usr/bin/env python3
"""Compile every plugin kernel of a config ahead of time (Triton -> PTX for sm_90) with the launch
parameters its TensorRT registration hands the builder; write <name>.ptx and kernels.json.

    python scripts/aot_kernels.py --config flash --dtype bf16 --out engines/flash/kernels
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

log = logging.getLogger("aot_kernels")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", choices=["tiny", "small", "flash"])
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    from dsflash.export.plugin_kernels import plugin_kernels, write_plugin_kernels
    from dsflash.model.config import ModelConfig

    start = time.perf_counter()
    kernels = plugin_kernels(ModelConfig.preset(args.config), DTYPES[args.dtype])
    path = write_plugin_kernels(kernels, args.out)
    for name, (k, _) in kernels.items():
        log.info("%-28s %-32s warps %d  shared %6d B  params %d", name, k.name, k.num_warps,
                 k.shared_mem, k.params)
    log.info("%d kernels in %.1f s -> %s", len(kernels), time.perf_counter() - start, path)


if __name__ == "__main__":
    main()
