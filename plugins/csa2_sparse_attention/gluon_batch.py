"""Csa2SparseAttention's batch form as a warp-specialized Gluon kernel for sm_90 (64 heads of 64,
128, 256 or 512 dims, 16-bit operands): the outputs of csa2_sparse_attention_kernel's batch form (the split
partials, or the finished rows) over the same key list and splits (splits.py), in 64-key blocks.

Why a second kernel. The Triton kernel's batch form spends most of its time outside the memory
system: at 64 rows of 128K on an H100 it takes 44.1 us with random picks and still 40.3 us with
no picks at all (scripts/attention_ablation.py, 2026-12-05). Its sm_90 compile (TTGIR) shows why:
the logits product Q K^T feeds the second product, so Triton gives it all 8 warps along its 64
rows (warpsPerCTA [8, 1]); both warpgroups then compute the same 64 x 32 logits, in 16-column
wgmma steps that each re-read the 64 KB of Q from shared memory. Gluon sets the layouts and the
warps' roles by hand, in two partitions:

- the softmax partition (one warpgroup) computes each block's 64 x 64 logits once (one wgmma per
  16 dims), masks them, updates the running max and sum (the sink's logit first, as the Triton
  kernel does), and hands p (16-bit) and the rescale factor over through a double buffer;
- the default partition (two warpgroups, each holding half of the [64, D] fp32 accumulator)
  gathers the blocks' rows with cp.async into two 64 KB stages, each stage's mbarrier completing
  when every thread's copies have landed (cp.async.mbarrier.arrive.noinc); per block it rescales
  and adds p V, then refills the freed stage with the block two ahead.

So the logits of block i + 1 run while p V of block i does, and the gathers overlap both. KB and
STAGES are compile-time: the launch's default is 64-key blocks in 2 stages; 32-key blocks fit 3
or 4 stages in the same shared memory (kernel.py's GLUON_KB / GLUON_STAGES), so that a refilled
stage has more blocks of work to land behind. They are slower from 12 rows (H100, session 39: 64
rows 34.0 against 27.8 us): the copies land early, but each block's logits, softmax and hand-over
cost about as much for 32 keys as for 64. Also measured slower there and dropped: block i + 1's
logits started during block i's softmax, and the key mask loaded a block ahead
(docs/benchmarks.md, session 39). A third, producer partition does not fit: ptxas allocates
every partition within the kernel's register limit, and 16 warps at the 154 registers the
accumulator's wgmma needs exceed the SM's 64K. No interpreter form: Gluon kernels compile for the
GPU only; the Triton kernel stays the launch on the CPU, for other shapes and for fp32. TensorRT
gets it as the attention plugin's GLUON tactic (trt.py, unsplit; compile_sm90 below builds the
same PTX offline). The kernel can be launched with programmatic dependent launch (PDL) as the
Triton kernels of the decode chain are (plugins/pdl.py; _wait_for_earlier_grids), but the JIT
launch takes it only when asked ({"PDL": True}; kernel.gluon_launch_pdl says why); the TensorRT
builds never do.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

SOFTMAX_WARPS = gl.constexpr(4)  # one warpgroup: the logits' wgmma needs four warps
# 12 warps share the 64K registers of an SM at 168 per thread (ptxas allocates every partition
# within the kernel's maxnreg, so the default partition's 128 accumulator registers per thread
# must fit under it); the softmax warpgroup needs no more
MAXNREG = 168
SOFTMAX_REGS = gl.constexpr(MAXNREG)


@gluon.jit
def _block_keys(j, row, N, T, K, sel_blocks, idx_ptr, wmask_ptr, KB: gl.constexpr, layout: gl.constexpr):
    """Key block j of query row `row` (selected blocks first, then window blocks): the entry ids
    (-1 where none), the window positions and which keys are real, as [KB] tensors in `layout`."""
    kk = gl.arange(0, KB, layout=layout)
    k = j * KB + kk
    in_sel = j < sel_blocks
    sel = gl.load(idx_ptr + row * K + k, mask=(k < K) & in_sel, other=-1).to(gl.int64)
    t = (j - sel_blocks) * KB + kk
    in_win = (t >= 0) & (t < T) & (j >= sel_blocks)
    win = gl.load(wmask_ptr + row * T + t, mask=in_win, other=0) != 0
    valid = gl.where(in_sel, (sel >= 0) & (sel < N), win)
    return sel, t, valid


@gluon.jit
def _wait_for_earlier_grids():
    """pdl.wait_for_earlier_grids for this kernel: griddepcontrol.wait, then launch_dependents,
    before anything touches memory. The default warps run it ahead of gl.warp_specialize; the
    softmax warpgroup starts its partition only after they reach it (a named barrier), and the
    wait makes the earlier grids' writes visible to the whole grid (PTX ISA, griddepcontrol), so
    one wait covers both partitions. Launched this way, the kernel's programs are set up while
    the top-k's rank launch before it finishes; each one still takes a whole SM (its 12 warps at
    MAXNREG registers fill the register file), so it starts only on an SM the rank has left."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.constexpr_function
def _copy_layout(warps):
    """The gathers' layout: 16-byte vectors, a warp over 4 rows x 64 columns per repetition."""
    return gl.BlockedLayout([1, 8], [4, 8], [warps, 1], [1, 0])


@gluon.jit
def _gather_keys(j, row, b, N, T, K, sel_blocks, kv_ptr, idx_ptr, win_ptr, wmask_ptr, D: gl.constexpr,
                 KB: gl.constexpr, WARPS: gl.constexpr):
    """The row addresses of key block j (selected entries, or window keys) and which rows are
    real keys, for _gather; loaded at the top of a step, before the copy that uses them, so that
    the ids' latency hides behind the step's waits and product."""
    rows_l: gl.constexpr = gl.SliceLayout(1, _copy_layout(WARPS))
    sel, t, valid = _block_keys(j, row, N, T, K, sel_blocks, idx_ptr, wmask_ptr, KB, rows_l)
    src = gl.where(j < sel_blocks, kv_ptr + (b * N + sel) * D, win_ptr + (b * T + t) * D)
    return src, valid


@gluon.jit
def _gather(src, valid, stage, ready, D: gl.constexpr, WARPS: gl.constexpr):
    """Start copying the rows at `src` into `stage`; `ready` completes its phase when every
    thread's copies have landed (one arrival per thread). Rows that are not real keys are
    zero-filled (a masked cp.async copies no bytes). One copy of the whole block: copies of
    64-column slices made the compiler put a barrier between slices (7 per block), for the
    same registers."""
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, _copy_layout(WARPS)))
    ptrs = gl.expand_dims(src, 1) + gl.expand_dims(cols, 0)
    async_copy.async_copy_global_to_shared(stage, ptrs, mask=gl.expand_dims(valid, 1))
    async_copy.mbarrier_arrive(ready, increment_count=False)


@gluon.jit
def _softmax(q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr, ml_ptr, row, b, N, T, K, sel_blocks,
             first, n_iter, part, smem, bars, H: gl.constexpr, D: gl.constexpr, SCALE: gl.constexpr,
             KB: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, NORMED: gl.constexpr):
    """The logits of each block once, the online softmax, p and the rescale factor out; at the
    end the split's max and sum to ml_ptr (SPLIT) and, where the accumulating partition divides by
    them (unsplit, or NORMED), to it through shared memory."""
    q_smem, kv_smem, p_smem, alpha_smem, stat_smem = smem
    kv_ready, p_ready, p_empty, done = bars
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[SOFTMAX_WARPS, 1],
                                                       instr_shape=[16, KB, 16])
    heads_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    # Q into shared memory once, 64 columns per copy
    COLS: gl.constexpr = 64
    copy: gl.constexpr = _copy_layout(SOFTMAX_WARPS)
    hh = gl.arange(0, H, layout=gl.SliceLayout(1, copy))
    cc = gl.arange(0, COLS, layout=gl.SliceLayout(0, copy))
    for c in gl.static_range(D // COLS):
        ptrs = q_ptr + gl.expand_dims((row * H + hh) * D, 1) + gl.expand_dims(c * COLS + cc, 0)
        async_copy.async_copy_global_to_shared(q_smem.slice(c * COLS, COLS, dim=1), ptrs)
    async_copy.commit_group()
    async_copy.wait_group(0)
    gl.thread_barrier()
    fence_async_shared()

    h = gl.arange(0, H, layout=heads_l)
    m_i = gl.load(sink_ptr + h).to(gl.float32)  # the sink's logit starts the running max
    l_i = gl.zeros([H], gl.float32, layout=heads_l)
    zero = gl.zeros([H, KB], gl.float32, layout=s_layout)
    for i in range(n_iter):
        j = first + i
        s = i % STAGES
        # which keys are real: loaded before the waits, so the loads' latency hides behind them
        valid = _block_keys(j, row, N, T, K, sel_blocks, idx_ptr, wmask_ptr, KB,
                            gl.SliceLayout(0, s_layout))[2]
        mbarrier.wait(kv_ready.index(s), (i // STAGES) & 1)
        fence_async_shared()
        kv = kv_smem.index(s)
        logits = warpgroup_mma(q_smem, kv.permute((1, 0)), zero, use_acc=False, is_async=True)
        logits, _, _ = warpgroup_mma_wait(0, deps=(logits, q_smem, kv))
        logits = gl.where(gl.expand_dims(valid, 0), logits * SCALE, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(logits, axis=1))
        alpha = gl.exp(m_i - m_new)
        p = gl.exp(logits - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        pb = i % 2
        mbarrier.wait(p_empty.index(pb), ((i // 2) & 1) ^ 1)
        p_smem.index(pb).store(p.to(kv_ptr.dtype.element_ty))
        alpha_smem.index(pb).store(alpha)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(p_ready.index(pb), count=1)
    if SPLIT:
        plane = part * 2 * H + h
        gl.store(ml_ptr + plane, m_i)
        gl.store(ml_ptr + plane + H, l_i)
    if not SPLIT or NORMED:
        stat_smem.index(0).store(m_i)
        stat_smem.index(1).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(done.index(0), count=1)


@gluon.jit
def _store_rows(tile, dst_ptr, kv_smem, H: gl.constexpr, D: gl.constexpr, WARPS: gl.constexpr):
    """Store the 16-bit [H, D] tile (the accumulator's wgmma layout: each thread holds pairs of
    columns of two rows, so direct stores would write half sectors, 8 rows x 16 bytes per warp) to
    the contiguous rows at dst_ptr in 16-byte vectors, through the key stages, which are free once
    the last product has waited: the softmax partition read its last stage before it sent the
    last p.

    The staging rows are XOR-swizzled in 16-byte chunks by row (mod 8). Unswizzled, every row
    starts on bank 0, and each warp's stmatrix hit the same banks 8 times: the store took 3.7 us
    of a 27 us program, 1.7 us swizzled (H100, clock64 stamps, 2026-12-05)."""
    dtype: gl.constexpr = tile.dtype
    VEC: gl.constexpr = 16 // (dtype.primitive_bitwidth // 8)
    swizzled: gl.constexpr = gl.SwizzledSharedLayout(VEC, 1, 8, order=[1, 0])
    staging = kv_smem._reinterpret(dtype, [H, D], swizzled)
    staging.store(tile)
    gl.thread_barrier()
    rows: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // D if D < 32 * VEC else 1,
                                                     D // VEC if D < 32 * VEC else 32], [WARPS, 1], [1, 0])
    h = gl.arange(0, H, layout=gl.SliceLayout(1, rows))
    dd = gl.arange(0, D, layout=gl.SliceLayout(0, rows))
    gl.store(dst_ptr + gl.expand_dims(h * D, 1) + gl.expand_dims(dd, 0), staging.load(rows))


@gluon.jit
def _accumulate(q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr, out_ptr, acc_ptr, row, b, N, T, K,
                sel_blocks, first, n_iter, part, smem, bars, H: gl.constexpr, D: gl.constexpr,
                KB: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr, NORMED: gl.constexpr,
                WARPS: gl.constexpr):
    """The default partition (two warpgroups, each half of the [H, D] fp32 accumulator): start
    the first STAGES gathers; per block acc = acc * alpha + p V, then refill the freed stage with
    the block STAGES ahead at once; at the end the partial (fp32, or NORMED: divided by its sum,
    16-bit) or the finished row."""
    q_smem, kv_smem, p_smem, alpha_smem, stat_smem = smem
    kv_ready, p_ready, p_empty, done = bars
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WARPS // 4],
                                                       instr_shape=[16, D // (WARPS // 4), 16])
    heads_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    # the first blocks' addresses all load before any copy starts: one load latency, not one
    # per stage (the copies wait for their addresses; 1.5 us from the partition's start to the
    # second copy with the loads in turn, H100, two stages)
    gl.static_assert(STAGES >= 2, "the prologue starts at least two stages")
    srcs = ()
    valids = ()
    for st in gl.static_range(STAGES):
        src_st, valid_st = _gather_keys(first + st, row, b, N, T, K, sel_blocks, kv_ptr, idx_ptr, win_ptr,
                                        wmask_ptr, D, KB, WARPS)
        srcs = srcs + (src_st,)
        valids = valids + (valid_st,)
    for st in gl.static_range(STAGES):
        if n_iter > st:
            _gather(srcs[st], valids[st], kv_smem.index(st), kv_ready.index(st), D, WARPS)
    acc = gl.zeros([H, D], gl.float32, layout=o_layout)
    for i in range(n_iter):
        s = i % STAGES
        pb = i % 2
        # the refill's addresses load now and arrive while this block waits and multiplies
        src, valid = _gather_keys(first + i + STAGES, row, b, N, T, K, sel_blocks, kv_ptr, idx_ptr, win_ptr,
                                  wmask_ptr, D, KB, WARPS)
        mbarrier.wait(p_ready.index(pb), (i // 2) & 1)
        mbarrier.wait(kv_ready.index(s), (i // STAGES) & 1)
        fence_async_shared()
        alpha = alpha_smem.index(pb).load(heads_l)
        acc = acc * gl.expand_dims(alpha, 1)
        acc = warpgroup_mma(p_smem.index(pb), kv_smem.index(s), acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(0, deps=(acc, p_smem.index(pb), kv_smem.index(s)))
        gl.thread_barrier()  # every warp's product has read p and the stage
        mbarrier.arrive(p_empty.index(pb), count=1)
        if i + STAGES < n_iter:  # the softmax partition read this stage before it sent p
            _gather(src, valid, kv_smem.index(s), kv_ready.index(s), D, WARPS)
    if SPLIT and not NORMED:
        # the fp32 partial straight from the registers: each warp store covers whole 32-byte
        # sectors (8 rows x 32 bytes), and the round trip through shared memory cost more (H100:
        # 16 rows in 4 splits 11.9 us against 13.4, 32 rows in 2 splits 16.5 against 17.5)
        hh = gl.arange(0, H, layout=heads_l)
        dd = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        gl.store(acc_ptr + part * H * D + gl.expand_dims(hh * D, 1) + gl.expand_dims(dd, 0), acc)
    elif SPLIT:
        # the partial divided by its own sum, in the operands' 16 bits (the combine weighs it back
        # by the sum): half the fp32 partial's bytes out here and into the combine, through the
        # unsplit form's store. A split that saw no key has l = 0 and writes zeros (weight 0).
        mbarrier.wait(done.index(0), 0)
        l_i = stat_smem.index(1).load(heads_l)
        out = acc * gl.expand_dims(gl.where(l_i > 0, 1.0 / l_i, 0.0), 1)
        _store_rows(out.to(acc_ptr.dtype.element_ty), acc_ptr + part * H * D, kv_smem, H, D, WARPS)
    else:
        mbarrier.wait(done.index(0), 0)
        m_i = stat_smem.index(0).load(heads_l)
        l_i = stat_smem.index(1).load(heads_l)
        sink = gl.load(sink_ptr + gl.arange(0, H, layout=heads_l)).to(gl.float32)
        # one reciprocal per head, then products: 128 fp32 divisions per thread cost more
        out = acc * gl.expand_dims(1.0 / (l_i + gl.exp(sink - m_i)), 1)
        _store_rows(out.to(out_ptr.dtype.element_ty), out_ptr + row * H * D, kv_smem, H, D, WARPS)


@gluon.jit
def csa2_sparse_attention_ws_kernel(q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr, S, N, T, K,
                                    blocks_per_split, out_ptr, acc_ptr, ml_ptr,
                                    H: gl.constexpr, D: gl.constexpr, SCALE: gl.constexpr,
                                    KB: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                                    num_warps: gl.constexpr, PDL: gl.constexpr = False,
                                    NORMED: gl.constexpr = False):
    """Grid (B * S query rows, 1, key splits); num_warps 8 (the default partition) plus the
    softmax warpgroup; launch with maxnreg MAXNREG. Arguments as csa2_sparse_attention_kernel's
    (the split form writes acc_ptr [rows, P, H, D] and ml_ptr [rows, P, 2, H], the unsplit
    out_ptr). NORMED (split form only): each partial divided by its own sum, in acc_ptr's 16-bit
    dtype (reference.csa2_attention_combine_normed reads it). PDL: launched with programmatic
    dependent launch (plugins/pdl.py; off in the AOT builds, which TensorRT launches itself)."""
    if PDL:
        _wait_for_earlier_grids()
    row = gl.program_id(0).to(gl.int64)
    b = row // S
    sel_blocks = gl.cdiv(K, KB)
    n_blocks = sel_blocks + gl.cdiv(T, KB)
    first = gl.program_id(2) * blocks_per_split
    n_iter = gl.maximum(gl.minimum(first + blocks_per_split, n_blocks) - first, 0)
    part = row * gl.num_programs(2) + gl.program_id(2)  # [B*S, P] flat

    gl.static_assert(STAGES * KB >= H, "the key stages also stage the 16-bit [H, D] result")
    dtype: gl.constexpr = kv_ptr.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [H, D], gl.NVMMASharedLayout.get_default_for([H, D], dtype))
    kv_smem = gl.allocate_shared_memory(dtype, [STAGES, KB, D],
                                        gl.NVMMASharedLayout.get_default_for([KB, D], dtype))
    p_smem = gl.allocate_shared_memory(dtype, [2, H, KB],
                                       gl.NVMMASharedLayout.get_default_for([H, KB], dtype))
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2, H], flat)
    stat_smem = gl.allocate_shared_memory(gl.float32, [2, H], flat)
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(s), count=num_warps * 32)  # one cp.async arrival per thread
    for s in gl.static_range(2):
        mbarrier.init(p_ready.index(s), count=1)
        mbarrier.init(p_empty.index(s), count=1)
    mbarrier.init(done.index(0), count=1)

    smem = (q_smem, kv_smem, p_smem, alpha_smem, stat_smem)
    bars = (kv_ready, p_ready, p_empty, done)
    gl.warp_specialize([
        (_accumulate, (q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr, out_ptr, acc_ptr, row, b, N, T,
                       K, sel_blocks, first, n_iter, part, smem, bars, H, D, KB, STAGES, SPLIT, NORMED,
                       num_warps)),
        (_softmax, (q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr, ml_ptr, row, b, N, T, K, sel_blocks,
                    first, n_iter, part, smem, bars, H, D, SCALE, KB, STAGES, SPLIT, NORMED)),
    ], [SOFTMAX_WARPS], [SOFTMAX_REGS])


def compile_sm90(split: bool, dim: int = 512, dtype=None, block_keys: int = 64, stages: int = 2,
                 pdl: bool = False, normed: bool = False):
    """The kernel compiled for sm_90 without a GPU, as the JIT launch builds it (64 heads, int64
    ids, 16-byte aligned pointers, `dtype` operands: torch.bfloat16 by default): Triton's compiled
    kernel, with its PTX and metadata (shared memory, warps), for checks of the build on any
    machine. The types are the Triton kernel's (trt.kernel_signature): both kernels take the same
    arguments. `pdl`: the build the JIT launch takes under {"PDL": True} (the PDL constant on); `normed`: the
    split form's 16-bit partials, each divided by its sum (the NORMED constant; acc_ptr in `dtype`)."""
    import torch

    from dsflash.plugins.aot import compile_kernel
    from dsflash.plugins.csa2_sparse_attention.trt import kernel_signature

    types = kernel_signature(dtype or torch.bfloat16)
    if normed:
        types["acc_ptr"] = types["q_ptr"]
    consts = {"H": 64, "D": dim, "SCALE": dim ** -0.5, "KB": block_keys, "STAGES": stages, "SPLIT": split,
              "num_warps": 8, "PDL": pdl, "NORMED": normed}
    pointers = tuple(a for a, t in types.items() if t.startswith("*"))
    return compile_kernel(csa2_sparse_attention_ws_kernel, types, consts, 8, divisible_by_16=pointers,
                          maxnreg=MAXNREG)


__all__ = ["MAXNREG", "SOFTMAX_REGS", "SOFTMAX_WARPS", "compile_sm90", "csa2_sparse_attention_ws_kernel"]
