"""How MhcBoundary's split form (decoder_step graphs: MhcBoundaryPartials, then MhcBoundaryFinish)
divides a token's channels (no Triton needed: the reference, the export, the JIT launchers and the
TensorRT shape function all read it).

Channels come in chunks of `block_e` (the partials kernel's BLOCK_E); split p holds chunks
[p * per, (p + 1) * per), the last one fewer. The number of splits aims at `split_target`
(block of ROW_BLOCK rows, split) programs, so up to 16 decode tokens spread over the GPU as the
JIT launcher splits one, while many rows keep one split each; never more than MAX_SPLITS (what
the finish merges per row in one load). Counted in row blocks, not rows, because the split count
is fixed by the shape function before TensorRT picks a tactic, and the 16-row tactic must still
fill the GPU: on the H200, 64 tokens in 5 splits (aimed per row) took 33.0 us, 2x the JIT launch.
Works on ints and on symbolic sizes through a `SizeOps` (plugins/sizes.py).
"""

from __future__ import annotations

from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.launch import next_pow2
from dsflash.plugins.sizes import H200_SMS, TORCH_SIZES, SizeOps

ROW_BLOCK = 16  # the partials kernel's tensor-core row block (ROWS_16)
MAX_SPLITS = 256  # the finish kernel loads every split's partials of a row at once ([NSP, M])
BLOCK_ES = (16, 32, 64, 128)  # the partials kernel's channel chunks


def split_plan(rows, hidden: int, block_e: int, split_target: int, ops: SizeOps = TORCH_SIZES) -> tuple:
    """(chunks per split, splits) for `rows` tokens (B*S) of `hidden` channels."""
    if block_e not in BLOCK_ES or split_target < 1:
        raise ValueError(f"MhcBoundaryPartials: block_e {block_e} must be one of {BLOCK_ES} and "
                         f"split_target {split_target} >= 1")
    chunks = cdiv(hidden, block_e)
    first = ops.max(ops.min(ops.cdiv(split_target, ops.cdiv(rows, ROW_BLOCK)), min(chunks, MAX_SPLITS)), 1)
    per = ops.cdiv(chunks, first)
    return per, ops.cdiv(chunks, per)


def channel_ranges(hidden: int, block_e: int, per: int, n_split: int) -> list[tuple[int, int]]:
    """[start, stop) of each split's channels (ints only: the reference's view of the plan)."""
    width = per * block_e
    return [(p * width, min((p + 1) * width, hidden)) for p in range(n_split)]


def chunk_width(hidden: int) -> int:
    """Channels per chunk of the channel loop (kernel.launch_config's BLOCK_E): 32, fewer for a
    narrower hidden size (one token: 8.3 us in 32-channel chunks, 9.8 in 64 on the H200)."""
    return min(32, next_pow2(hidden, 16))


def export_attrs(hidden: int) -> dict:
    """block_e and split_target as decoder_step graphs carry them: the JIT launch's chunk width
    and two programs per H200 SM (per row block), as the JIT launcher splits a decode token."""
    return {"block_e": chunk_width(hidden), "split_target": 2 * H200_SMS}
