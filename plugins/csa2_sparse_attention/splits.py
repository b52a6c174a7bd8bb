"""How Csa2SparseAttention's split form divides a query row's keys (no Triton needed: the
reference, the export, the JIT launcher and the TensorRT shape function all read it).

Keys come in blocks of `block_keys`: ceil(K / block_keys) blocks of the selected entries, then
ceil(T / block_keys) blocks of the window keys. A split takes `per` consecutive blocks of that
list (the last split may take fewer, and one split may hold the last selected block and the
first window block). The number of splits aims at `split_target` (row, split) programs per head
block, so one decode row spreads over the GPU while many rows keep one split each, and never
exceeds `max_splits(head_dim)` (what the combine kernel holds in registers).

`split_plan` works on ints and on symbolic sizes through a `SizeOps` (plugins/sizes.py).
"""

from __future__ import annotations

from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.launch import next_pow2
from dsflash.plugins.sizes import H200_SMS, TORCH_SIZES, SizeOps, trt_sizes

__all__ = ["AHEAD_ROWS", "BATCH_ROWS", "GLUON_ROWS", "H200_SMS", "TORCH_SIZES", "SizeOps", "batch_form",
           "default_split_target", "export_attrs", "gluon_form", "gluon_split_count", "key_blocks",
           "launch_config", "max_splits", "split_count", "split_plan", "trt_sizes"]

BATCH_ROWS = 16  # query rows from which wide heads take the batch form (batch_form)
AHEAD_ROWS = 64  # ... up to which it gathers 32-key blocks with the ids a step ahead; above, 64-key blocks
GLUON_ROWS = 4  # query rows from which 16-bit wide heads take the warp-specialized Gluon kernel (gluon_form)


def launch_config(heads: int, dim: int, ieee: bool, rows: int | None = None) -> dict:
    """Block sizes and warps of csa2_sparse_attention_kernel, shared by the JIT launch, the AOT
    compile and the split form's attribute (block_keys = BLOCK_K). For head_dim 512 the H200
    sweeps (docs/benchmarks.md) put 16 heads x 32 keys x 4 warps first at decode, with one key
    block per split (20 splits: 7.4 us unpipelined; 2 blocks 10.5 us, 4 blocks 15.0 us, no split
    28.5 us; 32 heads 10.1 us), and up to 8 rows. `rows` (the JIT launch's B*S; None: the AOT
    build, whose batch is not known when it compiles) from BATCH_ROWS selects batch_form."""
    block_d = next_pow2(dim, 16)
    wide = block_d >= 256
    if wide and batch_form(heads, dim, rows, ieee):
        # all 64 heads in one program: the tensor cores' 64-row products (wgmma) instead of
        # four 16-row programs each reading every key; 8 warps (up to 192 KB of shared memory,
        # one program per SM: split_count keeps the grid to one wave). Up to AHEAD_ROWS rows:
        # 32-key blocks in 3 stages whose entry ids load one step ahead (INDEX_AHEAD), so a
        # block's row gather is not held behind the wait for its own ids; above, where a row
        # keeps one split, 64-key blocks in 2 stages (bench_layer_batch.py --attn-configs,
        # 2026-12-05, on an H100: 16 / 24 / 32 / 48 / 64 rows 21.9 / 23.8 / 27.4 / 40.4 / 44.5 us
        # against 23.2 / 25.0 / 31.7 / 42.2 / 48.1 for session 27's blocks; 72 / 80 / 96 rows
        # 61.7 / 62.1 / 62.8 against 60.5 / 60.8 / 61.4 for the 64-key blocks).
        if rows <= AHEAD_ROWS:
            return {"BLOCK_H": 64, "BLOCK_K": 32, "BLOCK_D": block_d, "IEEE": ieee, "num_warps": 8,
                    "num_stages": 3, "INDEX_AHEAD": True}
        return {"BLOCK_H": 64, "BLOCK_K": 64, "BLOCK_D": block_d, "IEEE": ieee, "num_warps": 8,
                "num_stages": 2}
    block_h = 16 if wide else min(next_pow2(heads, 16), 64)
    return {"BLOCK_H": block_h, "BLOCK_K": 32 if wide else 64, "BLOCK_D": block_d, "IEEE": ieee,
            "num_warps": 4}


def batch_form(heads: int, dim: int, rows: int | None, ieee: bool) -> bool:
    """Whether `rows` query rows of `heads` x `dim` take launch_config's batch form: 64 heads of
    256-512 dims from BATCH_ROWS rows, 16-bit operands (ieee False: fp32 tiles of 64 heads x 512
    need 205-279 KB of shared memory, over the H200's 227 KB). H200 sweeps at 128K (bench_layer_batch.py --attn-configs,
    2026-12-04), us, the decode blocks (16 heads x 32 keys, 4 warps) against the batch form
    (64 heads, 8 warps, 2 stages, split_count's splits; 32 / 64-key blocks):
    8 rows 17.5 against 18.0 (64 keys), 16 rows 37.0 against 21.4 / 23.2, 24 rows 43.5 against
    24.5 / 22.3, 32 rows 52.2 against 29.3 / 28.6, 64 rows 77.2 against 51.7 / 44.1, 128 rows
    130.6 against 76.4 / 62.2."""
    return _wide_16bit(heads, dim, ieee) and rows is not None and rows >= BATCH_ROWS


def _wide_16bit(heads: int, dim: int, ieee: bool) -> bool:
    """64 heads of 256-512 dims in 16-bit operands: the shapes of batch_form and gluon_form."""
    return not ieee and heads == 64 and 256 <= next_pow2(dim, 16) <= 512


def gluon_form(heads: int, dim: int, rows: int | None, ieee: bool) -> bool:
    """Whether the JIT launch of `rows` query rows takes the warp-specialized Gluon kernel
    (kernel.py also asks for an sm_90 GPU and kernel.gluon_shape_problem's shapes): 64 heads of
    256-512 dims, 16-bit operands, from GLUON_ROWS rows, below BATCH_ROWS too, where the Triton
    launch keeps its decode blocks. H100, 128K entries per row, random picks
    (attention_ablation.py, one call, 2026-12-06), us, the decode blocks against the Gluon kernel
    in gluon_split_count's splits: 2 rows 9.4 against 10.2, 4 rows 12.9 against 11.0, 8 rows 18.6
    against 13.4, 12 rows 21.2 against 14.2."""
    return _wide_16bit(heads, dim, ieee) and rows is not None and rows >= GLUON_ROWS


def split_count(rows: int, head_blocks: int, sms: int = H200_SMS) -> int:
    """Key splits per row for the batch form: as many as keep rows x head blocks x splits within
    one program per SM (its shared memory allows no second one), at least one. A second wave
    cost more than the splits saved (64 rows, 32-key blocks: 2 splits 51.9 us, 4 splits 60.5;
    128 rows, 64-key blocks: 1 split 62.2 us, 2 splits 84.4)."""
    return max(1, sms // (rows * head_blocks))


def gluon_split_count(rows: int, sms: int = H200_SMS) -> int:
    """Key splits per row for the warp-specialized Gluon form (gluon_batch.py): about one program
    per two SMs, at least one split. Its programs pay a fixed start (ids, the first gathers and
    logits before the first product) and end (the result out through shared memory), and a split
    adds the combine launch and the fp32 partials' traffic, so fewer, longer programs win even
    with half the SMs idle: H100, 128K, random picks (attention_ablation.py --splits,
    2026-12-05), us for 1 / 2 / 3 / 4 / 8 splits: 16 rows 27.1 / 20.6 / 19.0 / 17.3 / 17.6,
    32 rows 27.8 / 22.2 / 23.0 / 24.6 / 34.7, 64 rows 28.7 / 36.9 / 46.7 / 51.6 / 61.7, 128 rows
    42.7 / 73.4 / 88.7 / 104.0 / 118.9."""
    return max(1, sms // 2 // rows)


def max_splits(dim: int) -> int:
    """The combine kernel holds [splits, head_dim] fp32 partials in registers: at most 16K values."""
    return max(1, 16384 // next_pow2(dim, 16))


def default_split_target(heads: int, dim: int, sms: int = H200_SMS) -> int:
    """(row, split) programs per head block that cover the GPU twice (the JIT launch's choice)."""
    return cdiv(2 * sms, cdiv(heads, launch_config(heads, dim, False)["BLOCK_H"]))


def export_attrs(heads: int, dim: int) -> dict:
    """The split node's block_keys and split_target as the export writes them (the kernel's
    key block, and the H200 target)."""
    return {"block_keys": launch_config(heads, dim, False)["BLOCK_K"],
            "split_target": default_split_target(heads, dim)}


def key_blocks(keys, window, block_keys: int):
    return cdiv(keys, block_keys) + cdiv(window, block_keys)


def split_plan(rows, keys, window, dim: int, block_keys: int, split_target: int, n_split=None,
               ops: SizeOps = TORCH_SIZES) -> tuple:
    """(blocks per split, splits) for `rows` query rows (B*S) over K selected and T window keys;
    `n_split` asks for a number of splits instead of the target (tests, sweeps). At least one
    split even without keys (it gives the output 0: all mass on the sink)."""
    if block_keys < 1 or split_target < 1:
        raise ValueError(f"Csa2SparseAttentionSplit: block_keys {block_keys} and split_target "
                         f"{split_target} must be >= 1")
    blocks = ops.max(key_blocks(keys, window, block_keys), 1)
    want = ops.cdiv(split_target, rows) if n_split is None else n_split
    first = ops.max(ops.min(ops.min(blocks, max_splits(dim)), want), 1)
    per = ops.cdiv(blocks, first)
    return per, ops.cdiv(blocks, per)
