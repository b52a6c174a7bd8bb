"""Csa2IndexScore over FP4 index keys on the FP8 tensor cores (bf16 queries).

The keys as the release stores them (model/quant.py:fp4_pow2_pack: e2m1 codes two per byte, one
power-of-two exponent per 32 channels; 68 B per 128-dim entry) become e4m3 bytes with a few bit
operations per four codes, exactly: for a nibble s|E1 E0|M, the byte s|0 0 E1 E0|M 0 0 is the e4m3
number grid(code) x 2^-6 (exponent field E, mantissa MSB M; E = 0 gives the e4m3 subnormal 2^-7 for
0.5 and zero for 0). kernel.py's decode to bf16 keys takes ~20 operations per code.

The queries go in as two e4m3 parts, q = a_h (hi + lo) per head with a power-of-two a_h that
puts the head's largest |q| in [128, 256): hi = q / a_h cut to its top 4 significant bits, lo =
the rest in e4m3, so a bf16 query (8 significant bits) is exact wherever lo is a multiple of
e4m3's smallest step 2^-9, i.e. for |q| down to about 2^-10 of the head's largest; smaller entries
lose low bits (they weigh under 2^-10 in the dot). Per scale group of 32 channels: the key tile
times hi, then times lo into the same tensor-core accumulator (m64n32k32 FP8 products), then x 2^e
per entry in one FMA per element; x 2^6 once per entry after the head sum, and a_h > 0 moves
through the ReLU into the head weight. The result matches the reference by the kernel tolerance
rule for bf16 (tests/test_kernels_gpu.py); fp32 and fp16 queries keep kernel.py's exact decode.

Channel order: the key tile of group g holds its 16 even channels (the codes' low nibbles) and
then its 16 odd ones, and the query tiles are permuted to match; a code word then converts into
one operand register per plane with no byte permutes (sm_90 SASS of the pipelined loop: 546
instructions per 128 entries against 710 in the natural, interleaved order).

H200, 2026-12-04 (docs/benchmarks.md, "CSA2 decode layers at a decode batch"), 128K entries per
row, 68 B each: one row 9.2-9.3 us (12.6-12.7 us on 2026-12-03; the decode path 25.2 us); 64
rows 340-346 us, 43% of the copy roofline (764.0 us in session 18's run). Past 8 rows
ncu finds the L2's tag lookups the busiest unit (78%), DRAM at 39%, 25% occupancy (registers
and shared memory both allow 4 programs of 4 warps per SM).
"""

from __future__ import annotations

import triton
import triton.language as tl

from dsflash.plugins.csa2_index_score.kernel import exact_pow2
from dsflash.plugins.pdl import wait_for_earlier_grids


@triton.jit
def _e4m3_planes(byte, ASM: tl.constexpr):
    """Code bytes -> (low-nibble, high-nibble) values as e4m3 bytes, each grid(code) x 2^-6. ASM:
    four bytes per 32-bit operation (inline PTX; the interpreter runs the same on single bytes)."""
    if ASM:
        # shift first, mask after (the masks keep each byte's bits in the byte), so that ptxas can
        # fold each and/or pair into one lop3: 4 + 3 operations per four bytes
        lo = tl.inline_asm_elementwise(
            "{ .reg .b32 a, b; shl.b32 a, $1, 4; shl.b32 b, $1, 2; and.b32 a, a, 0x80808080;"
            " and.b32 b, b, 0x1C1C1C1C; or.b32 $0, a, b; }", "=r,r", [byte], dtype=tl.uint8, is_pure=True,
            pack=4)
        hi = tl.inline_asm_elementwise(
            "{ .reg .b32 a, b; shr.b32 b, $1, 2; and.b32 a, $1, 0x80808080; and.b32 b, b, 0x1C1C1C1C;"
            " or.b32 $0, a, b; }", "=r,r", [byte], dtype=tl.uint8, is_pure=True, pack=4)
    else:
        lo = ((byte & 8) << 4) | ((byte & 7) << 2)
        hi = (byte & 0x80) | ((byte & 0x70) >> 2)
    return lo, hi


@triton.jit
def _query_scale(q_ptr, row, I: tl.constexpr, J: tl.constexpr, JP: tl.constexpr):
    """Per head: 1 / a_h with a_h = 2^(floor(log2(max |q_h|)) - 7), so max |q_h| / a_h is in
    [128, 256) (e4m3 reaches 448); capped at 2^127 for heads below 2^-120, 1 for all-zero heads."""
    ii = tl.arange(0, I)
    jj = tl.arange(0, JP)
    q = tl.load(q_ptr + (row * I + ii[:, None]) * J + jj[None, :], mask=(jj < J)[None, :], other=0.0)
    amax_exp = (tl.max(tl.abs(q.to(tl.float32)), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    inv_exp = tl.minimum(127 + 7 + 127 - amax_exp, 254)  # biased exponent of 2^(7 - (amax_exp - 127))
    return tl.where(amax_exp > 0, (inv_exp << 23).to(tl.float32, bitcast=True), 1.0), ii


@triton.jit
def _query_parts(q_ptr, row, I: tl.constexpr, J: tl.constexpr, JP: tl.constexpr):
    """The row's queries as (hi, lo) e4m3 tiles [I, 32] per scale group (tuples), 1 / a_h and the
    head index and whether any lo is nonzero. hi: q / a_h cut to 4 significant bits, which e4m3
    holds as it is (no rounding step); lo: the rest, 4 more bits for a bf16 query. A kv_qat query
    (model/attention.py: fp4_pow2_qat, e2m1 values of 2 significant bits times a power of two per
    32 channels) has no lo wherever its groups' scales lie within ~11 binades of its head's
    largest: hi holds it exactly."""
    inv_a, ii = _query_scale(q_ptr, row, I, J, JP)
    kk = tl.arange(0, 32)
    q_hi = ()
    q_lo = ()
    lo_max = 0.0
    for g in tl.static_range(J // 32):
        qs = tl.load(q_ptr + (row * I + ii[:, None]) * J + 32 * g + kk[None, :]).to(tl.float32)
        # the key tile's channel order, even channels then odd ones, by a permute in registers
        # (a gather in that order loads 2 bytes at a time: 2x slower at one row)
        qs = tl.reshape(tl.permute(tl.reshape(qs, [I, 16, 2]), (0, 2, 1)), [I, 32])
        qs = qs * inv_a[:, None]
        hi = (qs.to(tl.int32, bitcast=True) & -1048576).to(tl.float32, bitcast=True).to(tl.float8e4nv)
        q_hi = q_hi + (hi,)
        lo = (qs - hi.to(tl.float32)).to(tl.float8e4nv)
        q_lo = q_lo + (lo,)
        lo_max = tl.maximum(lo_max, tl.max(tl.max(tl.abs(lo.to(tl.float32)), axis=1), axis=0))
    return q_hi, q_lo, inv_a, ii, lo_max > 0.0


@triton.jit
def program_queries(q_ptr, w_ptr, S, I: tl.constexpr, J: tl.constexpr, JP: tl.constexpr):
    """A program's query row (grid axis 0 = B * S rows): (row, its batch index b, the query split
    as _query_parts makes it, the head weights times a_h (a_h > 0 passes through the ReLU),
    whether the split has a nonzero lo part)."""
    row = tl.program_id(0).to(tl.int64)
    q_hi, q_lo, inv_a, ii, has_lo = _query_parts(q_ptr, row, I, J, JP)
    w = tl.load(w_ptr + row * I + ii).to(tl.float32) / inv_a
    return row, row // S, q_hi, q_lo, w, has_lo


@triton.jit
def _exponent(exps_ptr, entry, live, g, G: tl.constexpr, EXP_WORDS: tl.constexpr):
    """Scale group g's int8 exponent per entry [BLOCK_N] (int32). EXP_WORDS: the exponents viewed
    as int32 words (four per word, little-endian), one 32-bit load per word instead of one byte
    load per group; the byte is moved to the top and shifted back down arithmetically (sign)."""
    if EXP_WORDS:
        word = tl.load(exps_ptr + entry * (G // 4) + g // 4, mask=live, other=0)
        return (word << (24 - 8 * (g % 4))) >> 24
    return tl.load(exps_ptr + entry * G + g, mask=live, other=0).to(tl.int32)


@triton.jit
def _fp4_block_dots(codes_ptr, exps_ptr, entry, live, q_hi, q_lo, I: tl.constexpr, J: tl.constexpr,
                    BLOCK_N: tl.constexpr, ASM: tl.constexpr, EXP_WORDS: tl.constexpr,
                    LO: tl.constexpr = True):
    """Per entry and head, 2^-6 keys . q / a_h [BLOCK_N, I] in fp32 for entries `entry` (loads
    masked by `live`): per scale group the e4m3 key tile times the query's hi part, then its lo part
    added in the same tensor-core accumulator, x 2^e in one FMA per element (the caller applies
    the 2^6 once per entry: at a decode batch the kernel issues about as many instructions as the
    bytes allow, and the per-element work of every group is what it spends them on)."""
    hb = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, I], dtype=tl.float32)
    for g in tl.static_range(J // 32):
        byte = tl.load(codes_ptr + entry[:, None] * (J // 2) + 16 * g + hb[None, :], mask=live[:, None],
                       other=0)
        lo, hi = _e4m3_planes(byte, ASM)
        # the 16 even channels (low nibbles) then the 16 odd ones: each 4-byte word of codes becomes
        # one tensor-core operand register per plane as it is, where the natural channel order
        # interleaves the planes byte by byte (16-bit shared loads and byte permutes to build
        # each register: ~150 PRMT per loop iteration in the sm_90 SASS); the query tiles are
        # loaded in the same channel order (_query_parts)
        keys = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [BLOCK_N, 32])
        keys = keys.to(tl.float8e4nv, bitcast=True)
        part = tl.dot(keys, tl.trans(q_hi[g]))
        if LO:  # the lo product; without it (a row of kv_qat queries) the same sums
            part = tl.dot(keys, tl.trans(q_lo[g]), part)
        acc += part * exact_pow2(_exponent(exps_ptr, entry, live, g, J // 32, EXP_WORDS))[:, None]
    return acc


@triton.jit
def _weighted_relu_sum(acc, w):
    """sum_h w_h relu(dots), the dots being 2^-6 of the true ones: x 2^6 (undoes the e4m3
    placement of the keys) once per entry; ReLU, the products and the sum commute with a power of
    two, so this rounds as scaling every dot would (outside fp32's subnormal range)."""
    return tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1) * 64.0


@triton.jit
def csa2_index_score_fp4_mma_kernel(q_ptr, w_ptr, codes_ptr, exps_ptr, vis_ptr, S, N, out_ptr,
                                    I: tl.constexpr, J: tl.constexpr, JP: tl.constexpr,
                                    BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, ASM: tl.constexpr,
                                    STAGES: tl.constexpr = 0, EXP_WORDS: tl.constexpr = False,
                                    LO_SKIP: tl.constexpr = False, PDL: tl.constexpr = False):
    """Grid (B * S query rows, runs of BLOCKS entry blocks of BLOCK_N): the query split is made
    once per program and serves its BLOCKS blocks. I heads (a power of two >= 16), J channels (a
    multiple of 32, JP the next power of two). STAGES 0: a block nothing sees is skipped whole
    (a branch per block); STAGES >= 2: a software-pipelined loop (the next blocks' codes load
    while one is multiplied), the code loads masked by visibility instead of the branch.

    Measured and dropped (H200, 2026-12-04, 64 rows x 128K, against 344.7-346.2 us for the
    launch of fp4_mma_config): code loads masked by the row's end only, so that no prefetch waits
    for the plain 1-byte visibility load (380.7 us at 128-entry blocks: +4 registers cost an
    SM a program; 324.0-332.9 us at 64-entry blocks under a 80-register cap, but 61-62 us against
    46 at 8 rows); each entry's 64 code bytes in one load, split into groups in registers, for
    whole-sector L2 requests (ncu found the L2 tag lookups 78% busy): 340.7 us, 333.2 under a
    128-register cap, 56.9 / 44.2 against 46.3 us at 8 rows. Session 36 (docs/benchmarks.md):
    each block's visibility taken from the run's, loaded before the loop (no load in the loop for
    the code copies to wait on): 2.5x slower (a cross-warp reduction per block).

    LO_SKIP: rows whose query split has no lo part (kv_qat's queries, as the model makes them) run
    a copy of the loop without the lo products. Off by default: the branch takes the kernel from
    128 registers per thread to 129, an SM then holds 3 programs instead of 4 (H200, 2026-12-06:
    61.0 against 46.0 us at 8 rows, 349.7 against 326.9 at 64, on kv_qat queries)."""
    wait_for_earlier_grids(PDL)
    row, b, q_hi, q_lo, w, has_lo = program_queries(q_ptr, w_ptr, S, I, J, JP)
    first = tl.program_id(1) * BLOCKS
    last = tl.minimum(first + BLOCKS, tl.cdiv(N, BLOCK_N))
    if LO_SKIP:  # a row without a lo part (kv_qat's queries) runs the loop without the lo products
        if has_lo:
            _mma_blocks(codes_ptr, exps_ptr, vis_ptr, out_ptr, row, b, N, first, last, q_hi, q_lo, w, I, J,
                        BLOCK_N, ASM, STAGES, EXP_WORDS, True)
        else:
            _mma_blocks(codes_ptr, exps_ptr, vis_ptr, out_ptr, row, b, N, first, last, q_hi, q_lo, w, I, J,
                        BLOCK_N, ASM, STAGES, EXP_WORDS, False)
    else:
        _mma_blocks(codes_ptr, exps_ptr, vis_ptr, out_ptr, row, b, N, first, last, q_hi, q_lo, w, I, J,
                    BLOCK_N, ASM, STAGES, EXP_WORDS, True)


@triton.jit
def _mma_blocks(codes_ptr, exps_ptr, vis_ptr, out_ptr, row, b, N, first, last, q_hi, q_lo, w, I: tl.constexpr,
                J: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr, STAGES: tl.constexpr,
                EXP_WORDS: tl.constexpr, LO: tl.constexpr):
    """Entry blocks [first, last) of one query row, scores stored (-inf where the row does not see
    the entry): the kernel's two loops (LO: with the lo products)."""
    if STAGES == 0:
        for blk in range(first, last):
            n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < N
            vis = tl.load(vis_ptr + row * N + n, mask=nmask, other=0) != 0
            score = tl.zeros([BLOCK_N], dtype=tl.float32)
            if tl.max(vis.to(tl.int32), axis=0) > 0:  # a block nothing sees is not read
                acc = _fp4_block_dots(codes_ptr, exps_ptr, b * N + n, nmask, q_hi, q_lo, I, J, BLOCK_N, ASM,
                                      EXP_WORDS, LO)
                score = _weighted_relu_sum(acc, w)
            tl.store(out_ptr + row * N + n, tl.where(vis, score, float("-inf")), mask=nmask)
    else:
        for blk in tl.range(first, last, num_stages=STAGES):
            n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < N
            vis = tl.load(vis_ptr + row * N + n, mask=nmask, other=0) != 0
            acc = _fp4_block_dots(codes_ptr, exps_ptr, b * N + n, nmask & vis, q_hi, q_lo, I, J, BLOCK_N,
                                  ASM, EXP_WORDS, LO)
            score = _weighted_relu_sum(acc, w)
            tl.store(out_ptr + row * N + n, tl.where(vis, score, float("-inf")), mask=nmask)
