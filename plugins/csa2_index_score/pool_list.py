"""The listed candidate pool's two small steps as Triton kernels, beside their references in
model/csa2_ops.py (same signatures):

- `pool_entry_list`: the pool's member mask [B, S, N] -> its ids in index order, -1 padded, in two
  launches over segments of each row: the segments' member counts, then each segment's ids after
  those of the segments before it. The PyTorch form (cumsum, where, scatter) took 28.8 us for one
  row of 128K entries and 393 us for 64 rows on the H200; one program per row scanning it chunk by
  chunk took 73.5 us at any batch (a chain of dependent prefix sums; docs/benchmarks.md, session 20).
- `listed_picks`: a top-k over the list mapped back to entry ids (-1 for padding) in one launch,
  instead of a gather, a comparison and a select.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.launch import check_device, check_dtype, check_shape, next_pow2, require
from dsflash.plugins.pdl import pdl_launch_args, wait_for_earlier_grids


@triton.jit
def pool_segment_counts_kernel(member_ptr, N, SEGS, counts_ptr, SEG: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (B * S rows, SEGS segments of SEG entries): the members of each segment.
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    n = seg * SEG + tl.arange(0, SEG)
    member = tl.load(member_ptr + row * N + n, mask=n < N, other=0) != 0
    tl.store(counts_ptr + row * SEGS + seg, tl.sum(member.to(tl.int32), axis=0))


@triton.jit
def pool_entry_list_kernel(member_ptr, counts_ptr, N, P, SEGS, PAD, out_ptr, SEG: tl.constexpr,
                           SEGS_P2: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (B * S rows, SEGS segments): a segment's members go to the list after the members of
    # the segments before it (their counts summed), in order (a prefix sum over the segment); the
    # program also pads its PAD slots of the list's tail. Members past P are dropped (the caller
    # sizes P to bound them).
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    seg = tl.program_id(1)
    segs = tl.arange(0, SEGS_P2)
    counts = tl.load(counts_ptr + row * SEGS + segs, mask=segs < SEGS, other=0)
    before = tl.sum(tl.where(segs < seg, counts, 0), axis=0)
    total = tl.sum(counts, axis=0)
    offs = tl.arange(0, SEG)
    n = seg * SEG + offs
    member = tl.load(member_ptr + row * N + n, mask=n < N, other=0) != 0
    rank = before + tl.cumsum(member.to(tl.int32), axis=0) - 1
    tl.store(out_ptr + row * P + rank, n.to(tl.int32), mask=member & (rank < P))
    for start in range(seg * PAD, (seg + 1) * PAD, SEG):
        slot = start + offs
        tl.store(out_ptr + row * P + slot, tl.full([SEG], -1, tl.int32),
                 mask=(slot >= total) & (slot < P) & (slot < (seg + 1) * PAD))


def pool_entry_list(member_BSN: torch.Tensor, size: int, *, overrides: dict | None = None) -> torch.Tensor:
    """model/csa2_ops.py:pool_entry_list's signature: member [B, S, N] bool -> ids [B, S, size]
    int32, ascending, -1 padded. Two launches over segments of SEG entries: their member counts,
    then each segment's ids at its place. `overrides`: SEG, num_warps, PDL (tests, benchmarks)."""
    op = "pool_entry_list"
    check_shape(op, "member", member_BSN, (None, None, None))
    check_dtype(op, "member", member_BSN, (torch.bool,))
    check_device(op, member=member_BSN)
    require(size >= 0, f"{op}: size {size} < 0")
    b, s, n = member_BSN.shape
    out = torch.empty(b, s, size, dtype=torch.int32, device=member_BSN.device)
    if out.numel() == 0:
        return out
    over = dict(overrides or {})
    pdl = pdl_launch_args(member_BSN.device, {"PDL": over.pop("PDL", True)})
    cfg = {"SEG": 4096, "num_warps": 4} | over
    segs = max(1, -(-n // cfg["SEG"]))
    member = member_BSN.contiguous().view(torch.uint8)
    counts = torch.empty(b * s, segs, dtype=torch.int32, device=member.device)
    pool_segment_counts_kernel[(b * s, segs)](member, n, segs, counts, **cfg, **pdl)
    pool_entry_list_kernel[(b * s, segs)](member, counts, n, size, segs, -(-size // segs), out,
                                          SEGS_P2=next_pow2(segs), **cfg, **pdl)
    return out


@triton.jit
def listed_picks_kernel(vals_ptr, pos_ptr, entries_ptr, K, P, W, out_ptr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    # Grid (B * S rows,): one row's W output columns, the top-k's K of them mapped.
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    for start in range(0, W, BLOCK):
        col = start + tl.arange(0, BLOCK)
        picked = col < K
        val = tl.load(vals_ptr + row * K + col, mask=picked, other=float("-inf"))
        pos = tl.load(pos_ptr + row * K + col, mask=picked, other=0)
        keep = picked & (val != float("-inf")) & (pos >= 0) & (pos < P)
        entry = tl.load(entries_ptr + row * P + pos, mask=keep, other=-1)
        tl.store(out_ptr + row * W + col, entry.to(tl.int64), mask=col < W)


def listed_picks(vals_BSK: torch.Tensor, pos_BSK: torch.Tensor, entries_BSP: torch.Tensor,
                 width: int) -> torch.Tensor:
    """model/csa2_ops.py:listed_picks's signature: ids [B, S, width] int64 of the picks, -1 for
    padding picked, for positions outside the list (unread) and past the top-k's K columns."""
    op = "listed_picks"
    check_shape(op, "vals", vals_BSK, (None, None, None))
    b, s, k = vals_BSK.shape
    check_shape(op, "pos", pos_BSK, (b, s, k))
    check_shape(op, "entries", entries_BSP, (b, s, None))
    check_dtype(op, "vals", vals_BSK, (torch.float32,))
    check_dtype(op, "pos", pos_BSK, (torch.int64, torch.int32))
    check_dtype(op, "entries", entries_BSP, (torch.int32, torch.int64))
    check_device(op, vals=vals_BSK, pos=pos_BSK, entries=entries_BSP)
    require(width >= k, f"{op}: width {width} < the top-k's {k} columns")
    out = torch.empty(b, s, width, dtype=torch.int64, device=vals_BSK.device)
    if out.numel() == 0:
        return out
    pdl = pdl_launch_args(vals_BSK.device, {"PDL": True})
    block = min(next_pow2(width, 16), 1024)
    listed_picks_kernel[(b * s,)](vals_BSK.contiguous(), pos_BSK.contiguous(), entries_BSP.contiguous(), k,
                                  entries_BSP.shape[2], width, out, BLOCK=block, num_warps=4, **pdl)
    return out
