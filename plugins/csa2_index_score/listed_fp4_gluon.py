"""Csa2IndexScore over a listed pool with FP4 keys as a Gluon kernel for sm_90: pooled_fp4.py's
scores (the same FP8 tensor-core products, in the same order, so the same bits), with the
copies and the products scheduled by hand.

Why a second kernel. Triton's pipelined form of pooled_fp4.py (3 stages) waits at every block
for all of its copies, the newest list ids among them (TTGIR: async_wait num = 0), so each block
pays the id -> codes load chain; and it waits for every group's product before it scales it
(warp_group_dot_wait pendings = 0 after each dot), so the tensor cores and the FMAs take turns.
Here:

- the list ids of block i + STAGES - 1 are loaded into registers one block ahead, so the codes'
  copy that needs them starts at once; the copies of a block (ids, codes, exponent words) are one
  cp.async group, and a block waits only for its own group (wait_group(STAGES - 2));
- group g + 1's products (hi, then lo into the same accumulator) are issued before group g's are
  scaled by 2^e: one group's wgmmas stay in flight while the FMAs of the one before run.

One partition of one warpgroup: a warp-specialized producer would need a second register budget
of the same size (ptxas allocates every partition under the kernel's maxnreg), where this leaves
4 programs per SM under a 128-register cap, as pooled_fp4.py's launch has.

The keys' bytes go from shared memory to registers in the layout that makes the tensor-core A
operand after the plane split (fp4_mma.py: even channels, then odd ones): each thread reads one
32-bit word of a group's 16 bytes for rows r and r + 8 of its warp's 16, so a group's bytes are
stored as their own [BLOCK_N, 16] tile (64-byte entry rows would put rows 0, 2, 4, 6 on the same
banks). No interpreter form: Gluon kernels compile for the GPU only; pooled_fp4.py stays the
launch on the CPU.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.launch import check_device, interpreting, require

WARPS = gl.constexpr(4)  # one warpgroup: the products' wgmma
MAXNREG = 128  # 128-entry blocks: 4 programs per SM (65,536 registers / (128 threads x 128))


@gluon.constexpr_function
def _mma_layout(heads):
    """The products' accumulator: [BLOCK_N entries, heads] over one warpgroup, k = 32 (FP8)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, heads, 32])


@gluon.constexpr_function
def _bytes_layout(block_n):
    """A group's [BLOCK_N, 16] code bytes as each thread needs them for the A operand
    (DotOperandLayout k_width 4 after the plane split): bytes 4t..4t+3 (t = lane % 4) of rows
    lane / 4 and lane / 4 + 8 of its warp's 16 rows, the next 64 rows in further registers."""
    regs = [[0, 1], [0, 2], [8, 0]] + [[64 * (1 << i), 0] for i in range((block_n // 64).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[block_n, 16])


@gluon.constexpr_function
def _copy_layout(block_n):
    """The codes' copy: [groups, BLOCK_N, 16] bytes in 16-byte vectors (a group's codes of one
    entry), one entry row per thread: the warps over the rows first (128 rows: all four, each
    thread copying its row's four groups), then over the groups (64 rows: two and two), so that
    no thread copies what another does and each computes one row's address. One copy per stage:
    copies into slices of one buffer each get a barrier before them (the shared-memory hazard
    analysis does not tell the slices apart)."""
    row_warps = min(WARPS, block_n // 32)
    return gl.BlockedLayout([1, 1, 16], [1, 32, 1], [WARPS // row_warps, row_warps, 1], [2, 1, 0])


@gluon.constexpr_function
def _ids_layout(block_n):
    """A block's ids as the codes' copy takes them (its entry rows)."""
    return gl.SliceLayout(0, gl.SliceLayout(2, _copy_layout(block_n)))


@gluon.jit
def _exact_pow2(e):
    """kernel.py:exact_pow2 (2^e for every int8 e, exactly), in Gluon."""
    half = e >> 1
    first = ((half + 127) << 23).to(gl.float32, bitcast=True)
    return first * ((e - half + 127) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _e4m3_planes(byte):
    """fp4_mma.py:_e4m3_planes (its ASM form): code bytes -> the low- and high-nibble values as
    e4m3 bytes, grid(code) x 2^-6, four bytes per 32-bit operation."""
    lo = gl.inline_asm_elementwise(
        "{ .reg .b32 a, b; shl.b32 a, $1, 4; shl.b32 b, $1, 2; and.b32 a, a, 0x80808080;"
        " and.b32 b, b, 0x1C1C1C1C; or.b32 $0, a, b; }", "=r,r", [byte], dtype=gl.uint8, is_pure=True, pack=4)
    hi = gl.inline_asm_elementwise(
        "{ .reg .b32 a, b; shr.b32 b, $1, 2; and.b32 a, $1, 0x80808080; and.b32 b, b, 0x1C1C1C1C;"
        " or.b32 $0, a, b; }", "=r,r", [byte], dtype=gl.uint8, is_pure=True, pack=4)
    return lo, hi


@gluon.jit
def _query_split(q_ptr, w_ptr, row, qhi_smem, qlo_smem, I: gl.constexpr, J: gl.constexpr,
                 heads_l: gl.constexpr):
    """fp4_mma.py:_query_parts into shared memory: per scale group the [I, 32] e4m3 tiles hi and
    lo of q / a_h in the keys' channel order (16 even channels, then 16 odd), a_h a power of two
    putting the head's largest |q| in [128, 256). Returns the head weights times a_h [I] (a_h > 0
    passes through the ReLU) and whether any lo is nonzero."""
    ql: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0])
    ii = gl.arange(0, I, layout=gl.SliceLayout(1, ql))
    jj = gl.arange(0, J, layout=gl.SliceLayout(0, ql))
    q = gl.load(q_ptr + gl.expand_dims((row * I + ii) * J, 1) + gl.expand_dims(jj, 0)).to(gl.float32)
    amax_exp = (gl.max(gl.abs(q), axis=1).to(gl.int32, bitcast=True) >> 23) & 0xFF
    inv_exp = gl.minimum(127 + 7 + 127 - amax_exp, 254)  # biased exponent of 2^(7 - (amax_exp - 127))
    inv_a = gl.where(amax_exp > 0, (inv_exp << 23).to(gl.float32, bitcast=True), 1.0)
    kk = gl.arange(0, 32, layout=gl.SliceLayout(0, ql))
    chan = gl.where(kk < 16, 2 * kk, 2 * (kk - 16) + 1)  # column k of a group's tile holds this channel
    lo_max = gl.zeros([I], gl.float32, layout=gl.SliceLayout(1, ql))
    for g in gl.static_range(J // 32):
        qs = gl.load(q_ptr + gl.expand_dims((row * I + ii) * J, 1) + gl.expand_dims(32 * g + chan, 0))
        qs = qs.to(gl.float32) * gl.expand_dims(inv_a, 1)
        hi = (qs.to(gl.int32, bitcast=True) & -1048576).to(gl.float32, bitcast=True).to(gl.float8e4nv)
        lo = (qs - hi.to(gl.float32)).to(gl.float8e4nv)
        qhi_smem.index(g).store(hi)
        qlo_smem.index(g).store(lo)
        lo_max = gl.maximum(lo_max, gl.max(gl.abs(lo.to(gl.float32)), axis=1))
    w = gl.load(w_ptr + row * I + gl.arange(0, I, layout=heads_l)).to(gl.float32)
    w = w / gl.convert_layout(inv_a, heads_l)
    return w, gl.max(lo_max, axis=0) > 0.0


@gluon.jit
def _issue_copies(blk, ids, row, b, N, P, end, codes_ptr, exps_ptr, entries_ptr, codes_smem, exps_smem,
                  ids_smem, stage, J: gl.constexpr, BLOCK_N: gl.constexpr):
    """One cp.async group: list block blk's ids, and the codes (one [BLOCK_N, 16] tile per scale
    group) and exponent word of its listed entries (`ids`, already in registers); slots from `end`
    on (past the program's run or the list) or with ids outside [0, N) copy nothing (zero-filled).
    The group is committed even when empty, so that every block waits for the same count."""
    G: gl.constexpr = J // 32
    cl: gl.constexpr = _copy_layout(BLOCK_N)
    rows_l: gl.constexpr = _ids_layout(BLOCK_N)
    p = blk * BLOCK_N + gl.arange(0, BLOCK_N, layout=rows_l)
    async_copy.async_copy_global_to_shared(ids_smem.index(stage), entries_ptr + row * P + p, mask=p < end)
    listed = (ids >= 0) & (ids < N)
    entry = (b * N + ids).to(gl.int64)
    async_copy.async_copy_global_to_shared(exps_smem.index(stage), exps_ptr + entry, mask=listed)
    gg = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, cl)))
    hb = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, cl)))
    g3 = gl.expand_dims(gl.expand_dims(gg, 1), 2)  # [G, 1, 1]
    h3 = gl.expand_dims(gl.expand_dims(hb, 0), 1)  # [1, 1, 16]
    src = codes_ptr + gl.expand_dims(gl.expand_dims(entry * (J // 2), 0), 2) + 16 * g3 + h3
    mask = gl.expand_dims(gl.expand_dims(listed, 0), 2) & (g3 < G) & (h3 < 16)  # [G, BLOCK_N, 16]
    async_copy.async_copy_global_to_shared(codes_smem.index(stage), src, mask=mask)
    async_copy.commit_group()


@gluon.jit
def _load_ids(blk, row, P, end, entries_ptr, BLOCK_N: gl.constexpr):
    """List block blk's ids in the copies' row layout (-1 from slot `end` on: the blocks after the
    program's run are the next program's, and the copies started ahead must not read them)."""
    p = blk * BLOCK_N + gl.arange(0, BLOCK_N, layout=_ids_layout(BLOCK_N))
    return gl.load(entries_ptr + row * P + p, mask=p < end, other=-1)


@gluon.jit
def _block_scores(codes_smem, exps_smem, ids_smem, qhi_smem, qlo_smem, stage, w, N,
                  I: gl.constexpr, J: gl.constexpr, BLOCK_N: gl.constexpr, LO: gl.constexpr):
    """One landed block's scores [BLOCK_N] (sum_h w_h relu(keys . q_h) x 2^6), -inf where the slot
    holds no id in [0, N): per group the hi (and lo) products issued before the previous group's
    sums are scaled by its 2^e."""
    G: gl.constexpr = J // 32
    mma_l: gl.constexpr = _mma_layout(I)
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=4)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma_l)
    bl: gl.constexpr = _bytes_layout(BLOCK_N)
    words = exps_smem.index(stage).load(rows_l)
    ids = ids_smem.index(stage).load(rows_l)
    zero = gl.zeros([BLOCK_N, I], gl.float32, layout=mma_l)
    acc = zero
    prev = zero
    for g in gl.static_range(G):
        byte = codes_smem.index(stage).reshape([G * BLOCK_N, 16]).slice(g * BLOCK_N, BLOCK_N).load(bl)
        lo, hi = _e4m3_planes(byte)
        keys = gl.reshape(gl.permute(gl.join(lo, hi), (0, 2, 1)), [BLOCK_N, 32])
        keys = gl.convert_layout(keys, a_l, assert_trivial=True).to(gl.float8e4nv, bitcast=True)
        part = warpgroup_mma(keys, qhi_smem.index(g).permute((1, 0)), zero, use_acc=False, is_async=True)
        if LO:
            part = warpgroup_mma(keys, qlo_smem.index(g).permute((1, 0)), part, is_async=True)
        if g > 0:  # the previous group's products are done once only this group's are in flight
            prev = warpgroup_mma_wait(2 if LO else 1, deps=(prev,))
            e = (words << (24 - 8 * ((g - 1) % 4))) >> 24
            acc += prev * gl.expand_dims(_exact_pow2(e), 1)
        prev = part
    prev = warpgroup_mma_wait(0, deps=(prev,))
    e = (words << (24 - 8 * ((G - 1) % 4))) >> 24
    acc += prev * gl.expand_dims(_exact_pow2(e), 1)
    score = gl.sum(gl.maximum(acc, 0.0) * gl.expand_dims(w, 0), axis=1) * 64.0
    return gl.where((ids >= 0) & (ids < N), score, float("-inf"))


@gluon.jit
def _listed_blocks(q_hi, q_lo, w, codes_ptr, exps_ptr, entries_ptr, out_ptr, row, b, N, P, first, n_iter,
                   smem, I: gl.constexpr, J: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   LO: gl.constexpr):
    """The run's blocks first .. first + n_iter - 1: STAGES - 1 blocks' copies in flight ahead of
    the block being multiplied."""
    codes_smem, exps_smem, ids_smem = smem
    rows_l: gl.constexpr = gl.SliceLayout(1, _mma_layout(I))
    end = gl.minimum((first + n_iter) * BLOCK_N, P)
    for st in gl.static_range(STAGES - 1):
        ids = _load_ids(first + st, row, P, end, entries_ptr, BLOCK_N)
        _issue_copies(first + st, ids, row, b, N, P, end, codes_ptr, exps_ptr, entries_ptr, codes_smem,
                      exps_smem, ids_smem, st, J, BLOCK_N)
    ids = _load_ids(first + STAGES - 1, row, P, end, entries_ptr, BLOCK_N)
    for i in range(n_iter):
        async_copy.wait_group(STAGES - 2)  # block i's group has landed (this thread's copies)
        gl.thread_barrier()  # every thread's copies of block i, and every read of block i - 1's stage
        nxt = first + i + STAGES - 1
        _issue_copies(nxt, ids, row, b, N, P, end, codes_ptr, exps_ptr, entries_ptr, codes_smem, exps_smem,
                      ids_smem, (i + STAGES - 1) % STAGES, J, BLOCK_N)
        ids = _load_ids(nxt + 1, row, P, end, entries_ptr, BLOCK_N)
        score = _block_scores(codes_smem, exps_smem, ids_smem, q_hi, q_lo, i % STAGES, w, N, I, J, BLOCK_N,
                              LO)
        p = (first + i) * BLOCK_N + gl.arange(0, BLOCK_N, layout=rows_l)
        gl.store(out_ptr + row * P + p, score, mask=p < P)
    async_copy.wait_group(0)  # no copy outlives the program


@gluon.jit
def csa2_index_score_fp4_listed_gluon_kernel(q_ptr, w_ptr, codes_ptr, exps_ptr, entries_ptr, S, N, P, out_ptr,
                                             I: gl.constexpr, J: gl.constexpr, BLOCK_N: gl.constexpr,
                                             BLOCKS: gl.constexpr, STAGES: gl.constexpr,
                                             num_warps: gl.constexpr):
    """Grid (B * S query rows, runs of BLOCKS list blocks of BLOCK_N slots), num_warps 4, launched
    with maxnreg MAXNREG. Arguments as pooled_fp4.py's kernel, with exps as int32 words (J = 128:
    one word of four exponents per entry) and int32 ids."""
    gl.static_assert(num_warps == WARPS, "one warpgroup")
    gl.static_assert(J == 128, "one exponent word per entry")
    gl.static_assert(STAGES >= 2, "at least one block's copies ahead")
    row = gl.program_id(0).to(gl.int64)
    b = row // S
    first = gl.program_id(1) * BLOCKS
    n_iter = gl.minimum(first + BLOCKS, gl.cdiv(P, BLOCK_N)) - first
    G: gl.constexpr = J // 32

    heads_l: gl.constexpr = gl.SliceLayout(0, _mma_layout(I))
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([I, 32], gl.float8e4nv)
    q_hi = gl.allocate_shared_memory(gl.float8e4nv, [G, I, 32], q_layout)
    q_lo = gl.allocate_shared_memory(gl.float8e4nv, [G, I, 32], q_layout)
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])  # per stage
    codes_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, G, BLOCK_N, 16],
                                           gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0]))
    exps_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], flat)
    ids_smem = gl.allocate_shared_memory(entries_ptr.dtype.element_ty, [STAGES, BLOCK_N], flat)
    w, has_lo = _query_split(q_ptr, w_ptr, row, q_hi, q_lo, I, J, heads_l)
    fence_async_shared()
    gl.thread_barrier()
    smem = (codes_smem, exps_smem, ids_smem)
    if has_lo:
        _listed_blocks(q_hi, q_lo, w, codes_ptr, exps_ptr, entries_ptr, out_ptr, row, b, N, P, first, n_iter,
                       smem, I, J, BLOCK_N, STAGES, True)
    else:
        _listed_blocks(q_hi, q_lo, w, codes_ptr, exps_ptr, entries_ptr, out_ptr, row, b, N, P, first, n_iter,
                       smem, I, J, BLOCK_N, STAGES, False)


def compile_sm90(block_n: int = 128, blocks: int = 16, stages: int = 4, heads: int = 32, j: int = 128,
                 maxnreg: int | None = MAXNREG):
    """The kernel compiled for sm_90 without a GPU, as the JIT launch builds it (16-byte aligned
    pointers): Triton's compiled kernel, with its PTX and metadata, for checks on any machine."""
    from dsflash.plugins.aot import compile_kernel

    types = {"q_ptr": "*bf16", "w_ptr": "*fp32", "codes_ptr": "*u8", "exps_ptr": "*i32",
             "entries_ptr": "*i32",
             "S": "i32", "N": "i32", "P": "i32", "out_ptr": "*fp32"}
    consts = {"I": heads, "J": j, "BLOCK_N": block_n, "BLOCKS": blocks, "STAGES": stages, "num_warps": WARPS}
    pointers = tuple(a for a, t in types.items() if t.startswith("*"))
    return compile_kernel(csa2_index_score_fp4_listed_gluon_kernel, types, consts, int(WARPS),
                          divisible_by_16=pointers, maxnreg=maxnreg)


def listed_gluon_problem(q_BSIJ: torch.Tensor) -> str | None:
    """Why the Gluon kernel cannot score these queries (None where it can): it needs an sm_90 GPU,
    bf16 queries, 16, 32 or 64 heads and 128 channels (one exponent word per
    entry)."""
    if q_BSIJ.dtype != torch.bfloat16:
        return f"the Gluon kernel takes bf16 queries, got {q_BSIJ.dtype}"
    heads, j = q_BSIJ.shape[2], q_BSIJ.shape[3]
    if heads not in (16, 32, 64):  # the accumulators of 128 heads would not fit the registers
        return f"the Gluon kernel takes 16, 32 or 64 heads, got {heads}"
    if j != 128:
        return f"the Gluon kernel takes 128 channels (one exponent word per entry), got {j}"
    if q_BSIJ.device.type != "cuda" or interpreting():
        return "the Gluon kernel runs on a CUDA GPU only (no interpreter form)"
    cap = torch.cuda.get_device_capability(q_BSIJ.device)
    if cap[0] != 9:
        return f"the Gluon kernel is written for sm_90 (wgmma), this GPU is sm_{cap[0]}{cap[1]}"
    return None


def listed_gluon_config(rows: int, p: int) -> dict:
    """Launch settings of the Gluon kernel for `rows` lists of p slots."""
    return {"BLOCK_N": 64, "BLOCKS": 16, "STAGES": 6}


def csa2_index_score_fp4_listed_gluon(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, codes_BNH: torch.Tensor,
                                      exps_BNG: torch.Tensor, entries_BSP: torch.Tensor, *,
                                      overrides: dict | None = None) -> torch.Tensor:
    """pooled_fp4.py:csa2_index_score_fp4_pooled's signature and scores (bit for bit), by the Gluon
    kernel; refuses (ValueError) what listed_gluon_problem names. `overrides` replaces the launch
    settings (BLOCK_N 64 or 128, BLOCKS, STAGES >= 2, maxnreg: benchmarks, tests)."""
    from dsflash.plugins.csa2_index_score.kernel import exponent_words
    from dsflash.plugins.csa2_index_score.pooled_fp4 import _check_listed

    op = "Csa2IndexScore(fp4, pooled, gluon)"
    n, p = _check_listed(op, q_BSIJ, w_BSI, codes_BNH, exps_BNG, entries_BSP)
    problem = listed_gluon_problem(q_BSIJ)
    require(problem is None, f"{op}: {problem}")
    check_device(op, q=q_BSIJ, w=w_BSI, codes=codes_BNH, exps=exps_BNG, entries=entries_BSP)
    b, s, heads, j = q_BSIJ.shape
    out = torch.empty(b, s, p, dtype=torch.float32, device=q_BSIJ.device)
    if out.numel() == 0:
        return out
    cfg = listed_gluon_config(b * s, p) | dict(overrides or {})
    require(cfg["BLOCK_N"] in (64, 128) and cfg["STAGES"] >= 2 and cfg["BLOCKS"] >= 1,
            f"{op}: BLOCK_N must be 64 or 128, STAGES >= 2 and BLOCKS >= 1, got {cfg}")
    maxnreg = cfg.pop("maxnreg", MAXNREG if cfg["BLOCK_N"] == 128 else None)
    exps = exponent_words(op, exps_BNG, j, {"EXP_WORDS": True})
    grid = (b * s, cdiv(cdiv(p, cfg["BLOCK_N"]), cfg["BLOCKS"]))
    csa2_index_score_fp4_listed_gluon_kernel[grid](
        q_BSIJ.contiguous(), w_BSI.contiguous(), codes_BNH.contiguous(), exps, entries_BSP.contiguous(), s, n,
        p, out, I=heads, J=j, **cfg, num_warps=int(WARPS),
        **({} if maxnreg is None else {"maxnreg": maxnreg}))
    return out
