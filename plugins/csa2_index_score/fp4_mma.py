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
lose low bits (they weigh under 2^-10 in the dot). Per scale group of 32 channels: two m64n32k32
FP8 products (keys x hi, keys x lo), then x 2^6 x 2^e per entry in fp32; a_h > 0 moves through
the ReLU into the head weight. The result matches the reference by the kernel tolerance rule for
bf16 (tests/test_kernels_gpu.py); fp32 and fp16 queries keep kernel.py's exact decode.

H200, 2026-12-03 (docs/benchmarks.md, two runs): 12.6-12.7 us at 128K entries against
25.4-26.1 us for the decode in the same runs (8.9 MB: 17-18% of the copy roofline), and ~8 us at
any size up to 32K: the time is each program's query split followed by its blocks one after
another, not bytes.

Key tile of group g: its 16 code bytes per entry (one contiguous load), the low- and
high-nibble planes joined side by side, which is the natural channel order of the query tile.
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
        lo = tl.inline_asm_elementwise(
            "{ .reg .b32 a, b; and.b32 a, $1, 0x08080808; shl.b32 a, a, 4; and.b32 b, $1, 0x07070707;"
            " shl.b32 b, b, 2; or.b32 $0, a, b; }", "=r,r", [byte], dtype=tl.uint8, is_pure=True, pack=4)
        hi = tl.inline_asm_elementwise(
            "{ .reg .b32 a, b; and.b32 a, $1, 0x80808080; and.b32 b, $1, 0x70707070; shr.b32 b, b, 2;"
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
    head index. hi: q / a_h cut to 4 significant bits, which e4m3 holds as it is (no rounding
    step); lo: the rest, 4 more bits for a bf16 query."""
    inv_a, ii = _query_scale(q_ptr, row, I, J, JP)
    kk = tl.arange(0, 32)
    q_hi = ()
    q_lo = ()
    for g in tl.static_range(J // 32):
        qs = tl.load(q_ptr + (row * I + ii[:, None]) * J + 32 * g + kk[None, :]).to(tl.float32)
        qs = qs * inv_a[:, None]
        hi = (qs.to(tl.int32, bitcast=True) & -1048576).to(tl.float32, bitcast=True).to(tl.float8e4nv)
        q_hi = q_hi + (hi,)
        q_lo = q_lo + ((qs - hi.to(tl.float32)).to(tl.float8e4nv),)
    return q_hi, q_lo, inv_a, ii


@triton.jit
def csa2_index_score_fp4_mma_kernel(q_ptr, w_ptr, codes_ptr, exps_ptr, vis_ptr, S, N, out_ptr,
                                    I: tl.constexpr, J: tl.constexpr, JP: tl.constexpr,
                                    BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, ASM: tl.constexpr,
                                    PDL: tl.constexpr = False):
    """Grid (B * S query rows, runs of BLOCKS entry blocks of BLOCK_N): the query split is made
    once per program and serves its BLOCKS blocks. I heads (a power of two >= 16), J channels (a
    multiple of 32, JP the next power of two)."""
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    q_hi, q_lo, inv_a, ii = _query_parts(q_ptr, row, I, J, JP)
    w = tl.load(w_ptr + row * I + ii).to(tl.float32) / inv_a  # a_h > 0 passes through the ReLU
    hb = tl.arange(0, 16)
    first = tl.program_id(1) * BLOCKS
    for blk in range(first, tl.minimum(first + BLOCKS, tl.cdiv(N, BLOCK_N))):
        n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        vis = tl.load(vis_ptr + row * N + n, mask=nmask, other=0) != 0
        score = tl.zeros([BLOCK_N], dtype=tl.float32)
        if tl.max(vis.to(tl.int32), axis=0) > 0:  # a block nothing sees is not read
            entry = b * N + n
            acc = tl.zeros([BLOCK_N, I], dtype=tl.float32)
            for g in tl.static_range(J // 32):
                byte = tl.load(codes_ptr + entry[:, None] * (J // 2) + 16 * g + hb[None, :],
                               mask=nmask[:, None], other=0)
                lo, hi = _e4m3_planes(byte, ASM)
                # channels 2c (low nibble) and 2c + 1 side by side: the group's natural channel order
                keys = tl.reshape(tl.join(lo, hi), [BLOCK_N, 32]).to(tl.float8e4nv, bitcast=True)
                part = tl.dot(keys, tl.trans(q_hi[g])) + tl.dot(keys, tl.trans(q_lo[g]))
                e = tl.load(exps_ptr + entry * (J // 32) + g, mask=nmask, other=0).to(tl.int32)
                acc += (part * 64.0) * exact_pow2(e)[:, None]  # x 2^6 undoes the e4m3 placement, exactly
            score = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1)
        tl.store(out_ptr + row * N + n, tl.where(vis, score, float("-inf")), mask=nmask)
