#!/usr/bin/env python3
"""Where the listed pool's FP4 index kernel (plugins/csa2_index_score/pooled_fp4.py) spends its time
at a decode batch: the same launch (a flash Reindex layer: 16,384 listed slots of 128K entries per
row, 32 heads x 128, kv_qat queries) timed over five patterns of listed ids, so the memory
system's share can be told from the products':

- `pool_blocks`: what a decode step reads: the candidate pool's 2,048 random blocks of 8
  consecutive entries (model/config.py: candidate_topk_blocks, candidate_block_size), ascending;
  a block's 8 code rows are 512 contiguous bytes and its 8 exponent words one 32-byte sector;
- `random`: 16,384 single random ids, ascending (a pool of one-entry blocks: each key's codes and
  exponent word in three sectors of their own, the worst case);
- `contiguous`: ids 0..16383 (the same bytes, read in order: whole lines, streamed);
- `one_entry`: every slot the same entry (each program re-reads one 68-byte key: no memory cost
  beyond the ids and scores);
- `none`: every slot -1 (the ids read and the scores written; no key read, no product);
- `gather_pool_blocks`, `gather_random`: those two patterns' ids read by
  listed_key_gather_kernel below instead: the same ids, keys and 4-byte results in the same
  pipelined loop and grid, but no products (each slot's 16 code words and exponent word XORed).
  What the memory system gives these bytes in that access pattern: the bound the products' kernel
  could reach if its compute were free.

Two rooflines per row count, at the measured copy bandwidth: the counted bytes
(bench_layer_batch.layer_bytes' "index_listed_fp4": each slot's id 4, codes 64, exponents 4,
score 4, and the queries; whole sectors in `pool_blocks`) and the same with a `random` slot's key in
whole sectors (the memory system moves 32-byte sectors: a 64-byte code row is two, its 4-byte
exponent word one more, so 28 bytes a slot more). Each timed as one CUDA-graph replay after a
256 MB read has evicted the L2 (bench_kernels.time_cold_ms). Writes index_fp4_ablation.json.

    python3 scripts/index_fp4_ablation.py --out DIR [--rows 32,64,128]
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
import triton
import triton.language as tl

log = logging.getLogger("index_fp4_ablation")
ENTRIES = 131072
PATTERNS = ("pool_blocks", "random", "contiguous", "one_entry", "none")
GATHERED = ("pool_blocks", "random")
COLUMNS = PATTERNS + tuple(f"gather_{p}" for p in GATHERED)
SECTOR = 32


@triton.jit
def listed_key_gather_kernel(codes_ptr, exps_ptr, entries_ptr, out_ptr, N, P, WORDS: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, STAGES: tl.constexpr):
    """Grid (rows, runs of BLOCKS list blocks of BLOCK_N slots), as pooled_fp4.py's pipelined launch
    with one query row per batch item: per listed slot its key's WORDS int32 code words and its
    exponent word XORed into one int32 (0 where the id is outside [0, N))."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * BLOCKS
    last = tl.minimum(first + BLOCKS, tl.cdiv(P, BLOCK_N))
    kw = tl.arange(0, WORDS)
    for blk in tl.range(first, last, num_stages=STAGES):
        p = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        pmask = p < P
        entry = tl.load(entries_ptr + row * P + p, mask=pmask, other=-1)
        live = (entry >= 0) & (entry < N)
        key = row * N + entry
        words = tl.load(codes_ptr + key[:, None] * WORDS + kw[None, :], mask=live[:, None], other=0)
        exps = tl.load(exps_ptr + key, mask=live, other=0)
        tl.store(out_ptr + row * P + p, tl.xor_sum(words, axis=1) ^ exps, mask=pmask)


def listed_key_gather(codes_RNW: torch.Tensor, exps_RN: torch.Tensor, ids_RP: torch.Tensor,
                      cfg: dict) -> torch.Tensor:
    """listed_key_gather_kernel's launch over int32 views of the keys (codes [R, N, W], exponent
    words [R, N]) and ids [R, P] int32, in cfg's blocks, runs and stages (pooled_fp4_config)."""
    rows, n, words = codes_RNW.shape
    p = ids_RP.shape[1]
    out = torch.empty(rows, p, dtype=torch.int32, device=ids_RP.device)
    runs = triton.cdiv(triton.cdiv(p, cfg["BLOCK_N"]), cfg["BLOCKS"])
    listed_key_gather_kernel[(rows, runs)](codes_RNW, exps_RN, ids_RP, out, n, p, WORDS=words,
                                           BLOCK_N=cfg["BLOCK_N"], BLOCKS=cfg["BLOCKS"],
                                           STAGES=cfg.get("STAGES", 3), num_warps=cfg.get("num_warps", 4))
    return out


def listed_key_gather_reference(codes_RNW: torch.Tensor, exps_RN: torch.Tensor, ids_RP: torch.Tensor,
                                cfg: dict) -> torch.Tensor:
    """listed_key_gather's result from PyTorch ops (cfg unused: the launch's settings)."""
    n, words = codes_RNW.shape[1:]
    live = (ids_RP >= 0) & (ids_RP < n)
    idx = ids_RP.long().clamp(0, n - 1)
    gathered = codes_RNW.gather(1, idx.unsqueeze(-1).expand(-1, -1, words))
    x = exps_RN.gather(1, idx)
    for k in range(words):
        x = x ^ gathered[..., k]
    return torch.where(live, x, torch.zeros_like(x))


def sector_padding(dim: int) -> int:
    """Bytes a random slot's key moves beyond its own: its codes (dim / 2 bytes, aligned) and its
    exponent word (dim / 32 bytes) each in whole 32-byte sectors (128 dims: 28)."""
    codes, exps = dim // 2, dim // 32
    return -(-codes // SECTOR) * SECTOR - codes + -(-exps // SECTOR) * SECTOR - exps


def rooflines_us(rows: int, gbps: float) -> dict:
    """The counted bytes (bench_layer_batch.layer_bytes) and those with the keys' sector padding,
    in us at `gbps`."""
    from bench_kernels import INDEX_DIM
    from bench_layer_batch import layer_bytes

    counted = layer_bytes(rows, ENTRIES, slots())["index_listed_fp4"]
    sectors = counted + rows * slots() * sector_padding(INDEX_DIM)
    return {"counted": counted / gbps / 1e3, "sectors": sectors / gbps / 1e3}


def slots() -> int:
    """A Reindex layer's listed slots per row (bench_kernels: the kept blocks x their entries)."""
    from bench_kernels import CAND_BLOCK, CAND_BLOCKS

    return CAND_BLOCKS * CAND_BLOCK


def listed_ids(pattern: str, rows: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, 1, slots] int32 ids of one pattern."""
    from bench_kernels import CAND_BLOCK, CAND_BLOCKS

    n = slots()
    if pattern == "pool_blocks":
        blocks = torch.rand(rows, ENTRIES // CAND_BLOCK, generator=gen, device="cuda").argsort(dim=1)
        first = blocks[:, :CAND_BLOCKS].sort(dim=1).values * CAND_BLOCK
        ids = (first.unsqueeze(-1) + torch.arange(CAND_BLOCK, device="cuda")).flatten(1)
    elif pattern == "random":
        ids = torch.rand(rows, ENTRIES, generator=gen, device="cuda").argsort(dim=1)[:, :n]
        ids = ids.sort(dim=1).values
    elif pattern == "contiguous":
        ids = torch.arange(n, device="cuda").expand(rows, n)
    elif pattern == "one_entry":
        ids = torch.full((rows, n), 12345, device="cuda")
    else:
        ids = torch.full((rows, n), -1, device="cuda")
    return ids.to(torch.int32).reshape(rows, 1, n).contiguous()


def fp4_inputs(rows: int, gen: torch.Generator) -> tuple:
    """(codes [rows, 128K, 64] uint8, exps [rows, 128K, 4] int8, kv_qat queries [rows, 1, 32, 128]
    bf16, head weights [rows, 1, 32]) on the GPU: any code byte, exponents in [-8, 0] as unit-normal
    keys get."""
    from bench_kernels import INDEX_DIM, INDEX_HEADS

    from dsflash.model.quant import fp4_pow2_qat

    codes = torch.randint(0, 256, (rows, ENTRIES, INDEX_DIM // 2), generator=gen, device="cuda",
                          dtype=torch.uint8)
    exps = torch.randint(-8, 1, (rows, ENTRIES, INDEX_DIM // 32), generator=gen, device="cuda",
                         dtype=torch.int8)
    q = torch.randn(rows, 1, INDEX_HEADS, INDEX_DIM, generator=gen, device="cuda")
    q = fp4_pow2_qat(q.to(torch.bfloat16))
    w = torch.randn(rows, 1, INDEX_HEADS, generator=gen, device="cuda")
    return codes, exps, q, w


def ablate(rows: int, gen: torch.Generator, gbps: float) -> dict:
    from bench_kernels import time_cold_ms

    from dsflash.plugins.csa2_index_score.pooled_fp4 import csa2_index_score_fp4_pooled, pooled_fp4_config

    codes, exps, q, w = fp4_inputs(rows, gen)
    out = {"rows": rows, "config": pooled_fp4_config(rows, slots(), q.device),
           "roofline_us": rooflines_us(rows, gbps), "us": {}}
    for pattern in PATTERNS:
        ids = listed_ids(pattern, rows, gen)
        run = lambda ids=ids: csa2_index_score_fp4_pooled(q, w, codes, exps, ids)  # noqa: E731
        out["us"][pattern] = 1e3 * time_cold_ms(run)
    for pattern in GATHERED:
        ids = listed_ids(pattern, rows, gen).view(rows, -1)
        args = (codes.view(torch.int32), exps.view(torch.int32).view(rows, ENTRIES), ids, out["config"])
        if not torch.equal(listed_key_gather(*args), listed_key_gather_reference(*args)):
            raise RuntimeError("listed_key_gather_kernel differs from its reference")
        out["us"][f"gather_{pattern}"] = 1e3 * time_cold_ms(lambda args=args: listed_key_gather(*args))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", default="32,64,128")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = [int(r) for r in a.rows.split(",")]
    if min(rows) < 1:
        raise SystemExit(f"--rows must be >= 1, got {a.rows}")
    if not torch.cuda.is_available():
        raise SystemExit("index_fp4_ablation.py needs a CUDA GPU")
    from bench_decode import copy_bandwidth_GBps

    gen = torch.Generator(device="cuda").manual_seed(0)
    gbps = copy_bandwidth_GBps("cuda")
    results = []
    for r in rows:
        results.append(ablate(r, gen, gbps))
        torch.cuda.empty_cache()
    report = {"device": torch.cuda.get_device_name(), "copy_GBps": gbps, "slots": slots(), "results": results}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "index_fp4_ablation.json").write_text(json.dumps(report, indent=1))
    log.info("%s, copy %.0f GB/s; us; the counted roofline's fraction of pool_blocks and random, the "
             "sector roofline's of random", report["device"], gbps)
    for res in results:
        us, roof = res["us"], res["roofline_us"]
        cells = "  ".join(f"{p} {us[p]:6.1f}" for p in COLUMNS)
        fractions = (100 * roof["counted"] / us["pool_blocks"], 100 * roof["counted"] / us["random"],
                     100 * roof["sectors"] / us["random"])
        log.info("%4d rows: %s  | counted %.1f (%.0f%%, %.0f%%), sectors %.1f (%.0f%%)", res["rows"], cells,
                 roof["counted"], fractions[0], fractions[1], roof["sectors"], fractions[2])


if __name__ == "__main__":
    main()
