#!/usr/bin/env python3
"""Parameter counts (meta device) and KV-cache bytes of a preset.

    python scripts/accounting.py --config flash
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from dsflash.model.accounting import (
    count_parameters,
    global_kv_bytes_per_token,
    max_sequences,
    per_sequence_bytes,
)
from dsflash.model.config import ModelConfig
from dsflash.model.model import DSFlashModel

log = logging.getLogger("accounting")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="flash", choices=["tiny", "small", "flash"])
    ap.add_argument("--context", type=int, default=1_048_576, help="context for the capacity plan")
    ap.add_argument("--budget-gib", type=float, default=100.0, help="KV budget for the capacity plan")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = ModelConfig.preset(args.config)
    t0 = time.perf_counter()
    log.info("building %s on the meta device ...", args.config)
    with torch.device("meta"):
        model = DSFlashModel(cfg)
    counts = count_parameters(model, cfg)
    log.info("built in %.1f s", time.perf_counter() - t0)
    print(f"config {args.config}: {cfg.num_hidden_layers} layers, first decoder layer "
          f"{cfg.first_decoder_layer}")
    print(f"parameters   backbone {counts.backbone:,} ({counts.backbone / 1e9:.2f} B)")
    print(f"             Engram tables {counts.engram_tables:,} ({counts.engram_tables / 1e9:.2f} B)")
    print(f"             total {counts.total:,}")
    print(f"activated    per prefill row {counts.activated_prefill_row:,} "
          f"({counts.activated_prefill_row / 1e9:.2f} B)")
    print(f"             per decode row  {counts.activated_decode_row:,} "
          f"({counts.activated_decode_row / 1e9:.2f} B)")
    for fmt in ("released", "bf16"):
        const = per_sequence_bytes(cfg, fmt)
        print(f"KV [{fmt:8s}] global KV {global_kv_bytes_per_token(cfg, fmt):,.1f} B/token; "
              f"per sequence: SWA rings {const['swa_rings']:,} B, compressor state "
              f"{const['compressor_state']:,} B, Engram lookback {const['engram_lookback']} B")
        budget = int(args.budget_gib * 2**30)
        print(f"             {max_sequences(cfg, budget, args.context, fmt)} sequences of "
              f"{args.context:,} tokens fit in {args.budget_gib:g} GiB")


if __name__ == "__main__":
    main()
