"""Csa2SparseAttention as one Triton kernel: each query row attends to its selected global
entries (gathered by index) and to its window keys in one online softmax, with the per-head
sink in the denominator. K = V (MQA latent), so every key row loaded serves all heads of a block.

Grid: (B * S query rows, head blocks of BLOCK_H). Keys stream through in blocks of BLOCK_K:
first the K selected entries (idx -1 = none), then the T window keys (win_mask). bf16/fp16
operands go to the tensor cores with fp32 accumulation (p is rounded to the operand dtype for
the second product, as flash attention does); fp32 operands use exact IEEE products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.launch import FLOATS, check_device, check_dtype, check_shape, next_pow2, require


@triton.jit
def _attend_block(acc, m_i, l_i, q, kv, valid, scale, IEEE: tl.constexpr):
    if IEEE:
        logits = tl.dot(q, tl.trans(kv), input_precision="ieee")
    else:
        logits = tl.dot(q, tl.trans(kv))
    logits = tl.where(valid[None, :], logits * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
    return acc, m_new, l_i


@triton.jit
def csa2_sparse_attention_kernel(q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr, S, N, T, K, out_ptr,
                                 H: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
                                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                                 IEEE: tl.constexpr):
    # TensorRT's AOT order (inputs, integer scalars, outputs); contiguous tensors, so strides
    # follow from the sizes; the softmax scale is a compile-time constant (an attribute).
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s = row % S
    scale = SCALE
    sq_b, sq_s, sq_h = S * H * D, H * D, D
    skv_b, skv_n = N * D, D
    si_b, si_s = S * K, K
    sw_b, sw_t = T * D, D
    sm_b, sm_s = S * T, T
    so_b, so_s, so_h = sq_b, sq_s, sq_h
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    q = tl.load(q_ptr + b * sq_b + s * sq_s + h[:, None] * sq_h + dd[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    # The sink joins the softmax as a logit with no value: start the running max there.
    m_i = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32)
    sink = m_i
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    kk = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        sel = tl.load(idx_ptr + b * si_b + s * si_s + k0 + kk, mask=k0 + kk < K, other=-1)
        valid = (sel >= 0) & (sel < N)
        kv = tl.load(kv_ptr + b * skv_b + sel[:, None] * skv_n + dd[None, :],
                     mask=valid[:, None] & dmask[None, :], other=0.0)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, kv, valid, scale, IEEE)
    for t0 in range(0, T, BLOCK_K):
        t = t0 + kk
        valid = tl.load(wmask_ptr + b * sm_b + s * sm_s + t, mask=t < T, other=0) != 0
        kv = tl.load(win_ptr + b * sw_b + t[:, None] * sw_t + dd[None, :],
                     mask=valid[:, None] & dmask[None, :], other=0.0)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, kv, valid, scale, IEEE)
    out = acc / (l_i + tl.exp(sink - m_i))[:, None]
    tl.store(out_ptr + b * so_b + s * so_s + h[:, None] * so_h + dd[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])


def csa2_sparse_attention(q_BSHD: torch.Tensor, kv_BND: torch.Tensor, idx_BSK: torch.Tensor,
                          win_kv_BTD: torch.Tensor, win_mask_BST: torch.Tensor, sink_H: torch.Tensor,
                          scale: float) -> torch.Tensor:
    op = "Csa2SparseAttention"
    check_shape(op, "q", q_BSHD, (None, None, None, None))
    b, s, h, d = q_BSHD.shape
    check_shape(op, "kv", kv_BND, (b, None, d))
    check_shape(op, "idx", idx_BSK, (b, s, None))
    check_shape(op, "win_kv", win_kv_BTD, (b, None, d))
    t = win_kv_BTD.shape[1]
    check_shape(op, "win_mask", win_mask_BST, (b, s, t))
    check_shape(op, "sink", sink_H, (h,))
    for name, x in (("q", q_BSHD), ("kv", kv_BND), ("win_kv", win_kv_BTD), ("sink", sink_H)):
        check_dtype(op, name, x, FLOATS)
    require(q_BSHD.dtype == kv_BND.dtype == win_kv_BTD.dtype,
            f"{op}: q, kv and win_kv must share a dtype, got {q_BSHD.dtype}, {kv_BND.dtype}, "
            f"{win_kv_BTD.dtype}")
    check_dtype(op, "idx", idx_BSK, (torch.int64, torch.int32))
    check_dtype(op, "win_mask", win_mask_BST, (torch.bool,))
    require(d <= 512, f"{op}: head_dim {d} > 512, the largest the kernel keeps in registers")
    check_device(op, q=q_BSHD, kv=kv_BND, idx=idx_BSK, win_kv=win_kv_BTD, win_mask=win_mask_BST,
                 sink=sink_H)
    q, kv, win = q_BSHD.contiguous(), kv_BND.contiguous(), win_kv_BTD.contiguous()
    idx, wmask = idx_BSK.contiguous(), win_mask_BST.contiguous().view(torch.uint8)
    out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    cfg = launch_config(h, d, q.dtype)
    grid = (b * s, triton.cdiv(h, cfg["BLOCK_H"]))
    csa2_sparse_attention_kernel[grid](q, kv, idx, win, wmask, sink_H.contiguous(), s, kv.shape[1], t,
                                       idx.shape[2], out, H=h, D=d, SCALE=float(scale), **cfg)
    return out


def launch_config(heads: int, dim: int, dtype: torch.dtype) -> dict:
    """Block sizes and warps, shared by the JIT launch and the AOT compile (trt.py)."""
    block_d = next_pow2(dim, 16)
    wide = block_d >= 256
    return dict(BLOCK_H=16 if wide else min(next_pow2(heads, 16), 64), BLOCK_K=32 if wide else 64,
                BLOCK_D=block_d, IEEE=dtype == torch.float32, num_warps=8 if wide else 4)
