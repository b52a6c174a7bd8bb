"""Csa2IndexScore as one Triton kernel: I[b,s,n] = sum_i w[b,s,i] relu(q[b,s,i,:] . k[b,n,:]),
-inf where entry n is not visible.

Grid: (B * S query rows, entry blocks of BLOCK_N). Each program loads one block of index keys
[BLOCK_N, J] once and multiplies it by the row's heads BLOCK_I at a time on the tensor cores
(fp32 accumulate; fp32 inputs use exact IEEE products, not tf32). A block with no visible entry
(a Reindex layer's candidate pool leaves most blocks out) skips the key load and the products:
the kernel then reads only the pooled keys, which is what makes hierarchical selection cheap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.launch import FLOATS, check_device, check_dtype, check_shape, next_pow2, require


@triton.jit
def csa2_index_score_kernel(q_ptr, w_ptr, k_ptr, vis_ptr, S, N, out_ptr,
                            I: tl.constexpr, J: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, IEEE: tl.constexpr):
    # TensorRT's AOT order (inputs, integer scalars, outputs); contiguous tensors, so strides
    # follow from the sizes.
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s = row % S
    sq_b, sq_s, sq_i = S * I * J, I * J, J
    sw_b, sw_s = S * I, I
    sk_b, sk_n = N * J, J
    sv_b, sv_s = S * N, N
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    vis = tl.load(vis_ptr + b * sv_b + s * sv_s + n, mask=nmask, other=0) != 0
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if tl.max(vis.to(tl.int32), axis=0) > 0:
        jj = tl.arange(0, BLOCK_J)
        keys = tl.load(k_ptr + b * sk_b + n[:, None] * sk_n + jj[None, :],
                       mask=nmask[:, None] & (jj < J)[None, :], other=0.0)
        for i0 in tl.static_range(0, I, BLOCK_I):
            ii = i0 + tl.arange(0, BLOCK_I)
            imask = ii < I
            q = tl.load(q_ptr + b * sq_b + s * sq_s + ii[:, None] * sq_i + jj[None, :],
                        mask=imask[:, None] & (jj < J)[None, :], other=0.0)
            if IEEE:
                dots = tl.dot(keys, tl.trans(q), input_precision="ieee")
            else:
                dots = tl.dot(keys, tl.trans(q))
            w = tl.load(w_ptr + b * sw_b + s * sw_s + ii, mask=imask, other=0.0).to(tl.float32)
            acc += tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)
    scores = tl.where(vis, acc, float("-inf"))
    tl.store(out_ptr + b * sv_b + s * sv_s + n, scores, mask=nmask)


def csa2_index_score(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, k_BNJ: torch.Tensor,
                     visible_BSN: torch.Tensor) -> torch.Tensor:
    op = "Csa2IndexScore"
    check_shape(op, "q", q_BSIJ, (None, None, None, None))
    b, s, i, j = q_BSIJ.shape
    check_shape(op, "w", w_BSI, (b, s, i))
    check_shape(op, "k", k_BNJ, (b, None, j))
    n = k_BNJ.shape[1]
    check_shape(op, "visible", visible_BSN, (b, s, n))
    for name, t in (("q", q_BSIJ), ("w", w_BSI), ("k", k_BNJ)):
        check_dtype(op, name, t, FLOATS)
    require(q_BSIJ.dtype == k_BNJ.dtype, f"{op}: q is {q_BSIJ.dtype} but k is {k_BNJ.dtype}")
    check_dtype(op, "visible", visible_BSN, (torch.bool,))
    require(j <= 256, f"{op}: index_head_dim {j} > 256, the largest the kernel keeps in registers")
    check_device(op, q=q_BSIJ, w=w_BSI, k=k_BNJ, visible=visible_BSN)
    q, k = q_BSIJ.contiguous(), k_BNJ.contiguous()
    w, vis = w_BSI.contiguous(), visible_BSN.contiguous().view(torch.uint8)
    out = torch.empty(b, s, n, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    cfg = launch_config(i, j, q.dtype)
    grid = (b * s, triton.cdiv(n, cfg["BLOCK_N"]))
    csa2_index_score_kernel[grid](q, w, k, vis, s, n, out, I=i, J=j, **cfg)
    return out


def launch_config(heads: int, dim: int, dtype: torch.dtype) -> dict:
    """Block sizes and warps, shared by the JIT launch and the AOT compile (trt.py)."""
    return dict(BLOCK_N=64 if dim <= 128 else 32, BLOCK_I=min(next_pow2(heads, 16), 32),
                BLOCK_J=next_pow2(dim, 16), IEEE=dtype == torch.float32, num_warps=4)
