"""Csa2SparseAttention as a Triton kernel: each query row attends to its selected global entries
(gathered by index) and to its window keys in one online softmax, with the per-head sink in the
denominator. K = V (MQA latent), so every key row loaded serves all heads of a block.

Grid: (B * S query rows, head blocks of BLOCK_H, key splits). Keys stream through in blocks of
BLOCK_K: first the K selected entries (idx -1 = none, as is anything outside [0, N)), then the T
window keys (win_mask). With few rows (decode) the key blocks are split over programs, each
writing its partial softmax, and a second small kernel combines them per (row, head)
(flash-decoding), so the whole GPU works on one token. bf16/fp16 operands go to the tensor cores
with fp32 accumulation (p is rounded to the operand dtype for the second product, as flash
attention does); fp32 operands use exact IEEE products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.launch import (
    FLOATS,
    LauncherBase,
    check_device,
    check_dtype,
    check_shape,
    next_pow2,
    require,
)
from dsflash.plugins.pdl import pdl_launch_args, wait_for_earlier_grids


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
def csa2_sparse_attention_kernel(q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr, S, N, T, K,
                                 blocks_per_split, out_ptr, ws_acc, ws_ml,
                                 H: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
                                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                                 SPLIT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    # TensorRT's AOT order (inputs, integer scalars, outputs), then the split path's workspace
    # (the TensorRT build compiles SPLIT = 0 and never touches it). Contiguous tensors, so
    # strides follow from the sizes; the softmax scale is a compile-time constant (an attribute).
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = row // S
    s = row % S
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    dd = tl.arange(0, BLOCK_D)
    dmask = dd < D
    hd_mask = hmask[:, None] & dmask[None, :]
    q = tl.load(q_ptr + ((b * S + s) * H + h[:, None]) * D + dd[None, :], mask=hd_mask, other=0.0)
    # The sink joins the softmax as a logit with no value: start the running max there.
    sink = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32)
    m_i = sink
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    kk = tl.arange(0, BLOCK_K)
    # keys: the K selected entries in blocks, then the T window keys; a split takes a run of
    # blocks. Two loops without branches inside, so the compiler can pipeline them.
    sel_blocks = tl.cdiv(K, BLOCK_K)
    n_blocks = sel_blocks + tl.cdiv(T, BLOCK_K)
    first = tl.program_id(2) * blocks_per_split
    last = tl.minimum(first + blocks_per_split, n_blocks)
    for blk in range(first, tl.minimum(last, sel_blocks)):
        k = blk * BLOCK_K + kk
        sel = tl.load(idx_ptr + (b * S + s) * K + k, mask=k < K, other=-1)
        valid = (sel >= 0) & (sel < N)  # idx -1 = none, as is anything outside [0, N)
        kv = tl.load(kv_ptr + (b * N + sel[:, None]) * D + dd[None, :],
                     mask=valid[:, None] & dmask[None, :], other=0.0)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, kv, valid, SCALE, IEEE)
    for blk in range(tl.maximum(first, sel_blocks), last):
        t = (blk - sel_blocks) * BLOCK_K + kk
        valid = tl.load(wmask_ptr + (b * S + s) * T + t, mask=t < T, other=0) != 0
        kv = tl.load(win_ptr + (b * T + t[:, None]) * D + dd[None, :],
                     mask=valid[:, None] & dmask[None, :], other=0.0)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, kv, valid, SCALE, IEEE)
    if SPLIT:  # partial softmax of this run of keys, for the combine kernel
        slot = (row * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
        hh = tl.arange(0, BLOCK_H)
        tl.store(ws_acc + (slot * BLOCK_H + hh[:, None]) * BLOCK_D + dd[None, :], acc)
        tl.store(ws_ml + slot * 2 * BLOCK_H + hh, m_i)
        tl.store(ws_ml + slot * 2 * BLOCK_H + BLOCK_H + hh, l_i)
    else:
        out = acc / (l_i + tl.exp(sink - m_i))[:, None]
        out_ptrs = out_ptr + ((b * S + s) * H + h[:, None]) * D + dd[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=hd_mask)


@triton.jit
def csa2_attention_combine_kernel(ws_acc, ws_ml, sink_ptr, n_split, out_ptr, H: tl.constexpr,
                                  D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                                  NSP: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (query rows, heads): the n_split partial softmaxes of one head in one load each
    (maxima, sums, outputs), weighted by exp(m_p - m) and normalised with the sink."""
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, NSP)
    ok = sp < n_split
    dd = tl.arange(0, BLOCK_D)
    slot = (row * tl.cdiv(H, BLOCK_H) + h // BLOCK_H) * n_split + sp
    hh = h % BLOCK_H
    m_p = tl.load(ws_ml + slot * 2 * BLOCK_H + hh, mask=ok, other=float("-inf"))
    l_p = tl.load(ws_ml + slot * 2 * BLOCK_H + BLOCK_H + hh, mask=ok, other=0.0)
    part = tl.load(ws_acc + (slot[:, None] * BLOCK_H + hh) * BLOCK_D + dd[None, :],
                   mask=ok[:, None] & (dd < D)[None, :], other=0.0)
    sink = tl.load(sink_ptr + h).to(tl.float32)
    m_all = tl.maximum(sink, tl.max(m_p, axis=0))
    w = tl.exp(m_p - m_all)  # 0 for absent splits
    out = tl.sum(w[:, None] * part, axis=0) / (tl.sum(w * l_p, axis=0) + tl.exp(sink - m_all))
    tl.store(out_ptr + (row * H + h) * D + dd, out.to(out_ptr.dtype.element_ty), mask=dd < D)


def _check(q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H):
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


class SparseAttentionLauncher(LauncherBase):
    """Splits the key list of each (query row, head block) over programs when there are too few
    rows to fill the GPU (decode: 640 keys, 4 head blocks): each program writes its partial
    softmax to a workspace and a second, small launch combines them per (row, head), in
    parallel over heads (flash-decoding). A merge inside the first launch (the last program of a
    pair reading every partial, 32 KB each at head_dim 512) serialised on one program and cost
    more than the second launch (docs/benchmarks.md). Holds the workspace; one instance per
    device/stream, calls on it must not overlap."""

    def _workspace(self, device, slots: int, block_h: int, block_d: int):
        key = (device, block_h, block_d)
        ws = self._ws.get(key)
        if ws is None or ws[1].shape[0] < slots:
            ws = (torch.empty(slots, block_h, block_d, dtype=torch.float32, device=device),
                  torch.empty(slots, 2, block_h, dtype=torch.float32, device=device))
            self._ws[key] = ws
        return ws

    def __call__(self, q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H, scale: float,
                 n_split: int | None = None):
        _check(q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H)
        b, s, h, d = q_BSHD.shape
        t = win_kv_BTD.shape[1]
        q, kv, win = q_BSHD.contiguous(), kv_BND.contiguous(), win_kv_BTD.contiguous()
        idx, wmask = idx_BSK.contiguous(), win_mask_BST.contiguous().view(torch.uint8)
        sink = sink_H.contiguous()
        out = torch.empty_like(q)
        if out.numel() == 0:
            return out
        cfg = launch_config(h, d, q.dtype) | self._overrides
        pdl = pdl_launch_args(q.device, {"PDL": cfg.pop("PDL", True)})
        per_min = cfg.pop("MIN_BLOCKS_PER_SPLIT")
        h_blocks = triton.cdiv(h, cfg["BLOCK_H"])
        pairs = b * s * h_blocks
        n_blocks = triton.cdiv(idx.shape[2], cfg["BLOCK_K"]) + triton.cdiv(t, cfg["BLOCK_K"])
        if n_split is None:  # split keys only until the grid covers the GPU twice
            n_split = max(1, min(triton.cdiv(n_blocks, per_min), triton.cdiv(2 * self._sms(q.device), pairs)))
        # the combine kernel holds [NSP, BLOCK_D] partials in registers: at most 16K values
        n_split = min(n_split, max(1, 16384 // cfg["BLOCK_D"]))
        per = triton.cdiv(n_blocks, max(1, n_split))
        n_split = triton.cdiv(n_blocks, per)
        split = n_split > 1
        ws = (self._workspace(q.device, pairs * n_split, cfg["BLOCK_H"], cfg["BLOCK_D"]) if split
              else (out, out))  # never touched
        # a split runs one key block: nothing for the software pipeline to overlap, and its
        # buffers cost time (H200 sweep at decode: 7.4 us unpipelined vs 8.7 us with 3 stages)
        stages = cfg.pop("num_stages", 1 if split and per == 1 else 3)
        csa2_sparse_attention_kernel[(b * s, h_blocks, n_split)](
            q, kv, idx, win, wmask, sink, s, kv.shape[1], t, idx.shape[2], per, out, *ws,
            H=h, D=d, SCALE=float(scale), SPLIT=split, num_stages=stages, **cfg, **pdl)
        if split:
            csa2_attention_combine_kernel[(b * s, h)](
                *ws, sink, n_split, out, H=h, D=d, BLOCK_H=cfg["BLOCK_H"], BLOCK_D=cfg["BLOCK_D"],
                NSP=next_pow2(n_split), num_warps=4, **pdl)
        return out


def csa2_sparse_attention(q_BSHD: torch.Tensor, kv_BND: torch.Tensor, idx_BSK: torch.Tensor,
                          win_kv_BTD: torch.Tensor, win_mask_BST: torch.Tensor, sink_H: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """The reference's signature; a fresh launcher (and workspace) per call. Hold a
    SparseAttentionLauncher to reuse the workspace."""
    return SparseAttentionLauncher()(q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H, scale)


def launch_config(heads: int, dim: int, dtype: torch.dtype) -> dict:
    """Block sizes and warps, shared by the JIT launch and the AOT compile (trt.py, which has no
    workspace and so never splits keys). For head_dim 512 the H200 sweeps (docs/benchmarks.md)
    put 16 heads x 32 keys x 4 warps first, with one key block per split at decode (20 splits:
    7.4 us unpipelined; 2 blocks 10.5 us, 4 blocks 15.0 us, no split 28.5 us; 32 heads 10.1 us).
    At 64 rows 32 heads per program ran faster (75.6 us vs 83.1 us); the AOT build shares this
    setting and decode is slower with it, so 16 stays."""
    block_d = next_pow2(dim, 16)
    wide = block_d >= 256
    block_h = 16 if wide else min(next_pow2(heads, 16), 64)
    return dict(BLOCK_H=block_h, BLOCK_K=32 if wide else 64, BLOCK_D=block_d, MIN_BLOCKS_PER_SPLIT=1,
                IEEE=dtype == torch.float32, num_warps=4)
