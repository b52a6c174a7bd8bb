"""Csa2SparseAttention as a Triton kernel: each query row attends to its selected global entries
(gathered by index) and to its window keys in one online softmax, with the per-head sink in the
denominator. K = V (MQA latent), so every key row loaded serves all heads of a block.

Keys stream through in blocks of BLOCK_K: first the K selected entries (idx -1 = none, as is
anything outside [0, N)), then the T window keys (win_mask). bf16/fp16 operands go to the tensor
cores with fp32 accumulation (p is rounded to the operand dtype for the second product, as flash
attention does); fp32 operands use exact IEEE products.

Two kernels:
- `csa2_sparse_attention_kernel`, grid (B * S query rows, head blocks of BLOCK_H): one program
  runs every key block of its row and head block. The TensorRT plugin compiles this one (an AOT
  plugin has no workspace), and the launcher uses it when the grid already fills the GPU.
- `csa2_sparse_attention_split_kernel`, one launch with few rows (decode: one row, 640 keys, 4
  head blocks): the key blocks are split over programs so that the whole GPU works on one token
  (flash-decoding), each split writing its partial softmax, and further programs of the same
  launch combine the partials per (row, head). Roles go by a start ticket (plugins/ticket_sync.py):
  the first tickets are the splits, the later ones the combines, and a combine waits only for
  splits that took lower tickets, so they are already running and the wait ends whatever the GPU
  keeps resident. The last program to leave clears the counters for the next launch (CUDA graphs).
  Session 4's form of this was two launches (the splits, then a combine kernel): 7.4 us at decode
  on the H200, two dependent launches; a merge by the last split program of a head block
  serialised on one program (16 us, docs/benchmarks.md).
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
    interpreting,
    next_pow2,
    require,
)
from dsflash.plugins.ticket_sync import wait_at_least


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
def _attend_run(q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr, row, hb, first, last, S, N, T, K,
                H: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr, BLOCK_H: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax of query row `row`, heads block `hb`, over key blocks [first, last) (the
    selected entries' blocks first, then the window's) -> (acc, m, l, sink) of the run; the sink
    starts the running max (it joins the softmax as a logit with no value)."""
    b = row // S
    s = row % S
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    dd = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + ((b * S + s) * H + h[:, None]) * D + dd[None, :],
                mask=hmask[:, None] & (dd < D)[None, :], other=0.0)
    sink = tl.load(sink_ptr + h, mask=hmask, other=0.0).to(tl.float32)
    m_i = sink
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    kk = tl.arange(0, BLOCK_K)
    dmask = dd < D
    # two loops without branches inside, so the compiler can pipeline them
    sel_blocks = tl.cdiv(K, BLOCK_K)
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
    return acc, m_i, l_i, sink


@triton.jit
def csa2_sparse_attention_kernel(q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr, S, N, T, K, out_ptr,
                                 H: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
                                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                                 IEEE: tl.constexpr):
    # TensorRT's AOT order (inputs, integer scalars, outputs). Contiguous tensors, so strides
    # follow from the sizes; the softmax scale is a compile-time constant (an attribute).
    row = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    n_blocks = tl.cdiv(K, BLOCK_K) + tl.cdiv(T, BLOCK_K)
    acc, m_i, l_i, sink = _attend_run(q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr, row, hb, 0,
                                      n_blocks, S, N, T, K, H, D, SCALE, BLOCK_H, BLOCK_K, BLOCK_D, IEEE)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    dd = tl.arange(0, BLOCK_D)
    out = acc / (l_i + tl.exp(sink - m_i))[:, None]
    tl.store(out_ptr + (row * H + h[:, None]) * D + dd[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(h < H)[:, None] & (dd < D)[None, :])


@triton.jit
def _combine_head(ws_acc, ws_ml, sink_ptr, out_ptr, pair, row, h, n_split, H: tl.constexpr,
                  D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NSP: tl.constexpr):
    """One (row, head): its n_split partial softmaxes in one load each (maxima, sums, outputs,
    through L2: they were written in this launch), weighted by exp(m_p - m), normalised with the
    sink."""
    sp = tl.arange(0, NSP)
    ok = sp < n_split
    dd = tl.arange(0, BLOCK_D)
    slot = pair * n_split + sp
    hh = h % BLOCK_H
    m_p = tl.load(ws_ml + slot * 2 * BLOCK_H + hh, mask=ok, other=float("-inf"), cache_modifier=".cg")
    l_p = tl.load(ws_ml + slot * 2 * BLOCK_H + BLOCK_H + hh, mask=ok, other=0.0, cache_modifier=".cg")
    part = tl.load(ws_acc + (slot[:, None] * BLOCK_H + hh) * BLOCK_D + dd[None, :],
                   mask=ok[:, None] & (dd < D)[None, :], other=0.0, cache_modifier=".cg")
    sink = tl.load(sink_ptr + h).to(tl.float32)
    m_all = tl.maximum(sink, tl.max(m_p, axis=0))
    w = tl.exp(m_p - m_all)  # 0 for absent splits
    out = tl.sum(w[:, None] * part, axis=0) / (tl.sum(w * l_p, axis=0) + tl.exp(sink - m_all))
    tl.store(out_ptr + (row * H + h) * D + dd, out.to(out_ptr.dtype.element_ty), mask=dd < D)


@triton.jit
def csa2_sparse_attention_split_kernel(q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr, S, N, T, K,
                                       rows, blocks_per_split, n_split, first_role, out_ptr, ws_acc, ws_ml,
                                       ctl, H: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
                                       BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                                       BLOCK_D: tl.constexpr, NSP: tl.constexpr, IEEE: tl.constexpr,
                                       ONE_LAUNCH: tl.constexpr, POLL_NS: tl.constexpr):
    """1-D grid of rows * head blocks * n_split split programs, then rows * H combine programs,
    in one launch (ONE_LAUNCH: roles by ticket, combines wait) or as two launches of the same
    kernel (roles first_role + program id, the launch boundary orders them). ctl (int32, zero
    between calls): [0] tickets, [1] programs gone, then per (row, head block) pair the splits
    done, then the pair's combines done."""
    H_BLOCKS: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    pairs = rows * H_BLOCKS
    n_splits = pairs * n_split
    if ONE_LAUNCH:
        ticket = tl.atomic_add(ctl, 1)  # start order (acq_rel)
    else:
        ticket = first_role + tl.program_id(0)
    if ticket < n_splits:
        pair = ticket // n_split
        sp = ticket % n_split
        first = sp * blocks_per_split
        n_blocks = tl.cdiv(K, BLOCK_K) + tl.cdiv(T, BLOCK_K)
        acc, m_i, l_i, _ = _attend_run(q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr,
                                       (pair // H_BLOCKS).to(tl.int64), pair % H_BLOCKS, first,
                                       tl.minimum(first + blocks_per_split, n_blocks), S, N, T, K, H, D,
                                       SCALE, BLOCK_H, BLOCK_K, BLOCK_D, IEEE)
        slot = ticket.to(tl.int64)  # = pair * n_split + sp
        hh = tl.arange(0, BLOCK_H)
        dd = tl.arange(0, BLOCK_D)
        tl.store(ws_acc + (slot * BLOCK_H + hh[:, None]) * BLOCK_D + dd[None, :], acc)
        tl.store(ws_ml + slot * 2 * BLOCK_H + hh, m_i)
        tl.store(ws_ml + slot * 2 * BLOCK_H + BLOCK_H + hh, l_i)
        tl.debug_barrier()  # every thread's partials are written before the count moves
        tl.atomic_add(ctl + 2 + pair, 1, sem="release")
    else:
        c = ticket - n_splits
        head = c % H
        of = c // H * H_BLOCKS + head // BLOCK_H  # the (row, head block) pair combined
        if ONE_LAUNCH:
            wait_at_least(ctl + 2 + of, n_split, POLL_NS)  # the splits of this pair took lower tickets
        _combine_head(ws_acc, ws_ml, sink_ptr, out_ptr, of.to(tl.int64), (c // H).to(tl.int64), head, n_split,
                      H, D, BLOCK_H, BLOCK_D, NSP)
        heads_here = tl.minimum(BLOCK_H, H - (head // BLOCK_H) * BLOCK_H)
        if tl.atomic_add(ctl + 2 + pairs + of, 1) == heads_here - 1:
            # every combine of the pair is past its wait: clear the pair's counts
            tl.store(ctl + 2 + of, 0)
            tl.store(ctl + 2 + pairs + of, 0)
    tl.debug_barrier()
    if tl.atomic_add(ctl + 1, 1) == n_splits + rows * H - 1:  # the last program to leave
        tl.store(ctl, 0)
        tl.store(ctl + 1, 0)


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


# One launch (ticket-ordered splits and combines) unless the overrides say ONE_LAUNCH=False (two
# launches of the same kernel, session 4's form).
ONE_LAUNCH_DEFAULT = True


class SparseAttentionLauncher(LauncherBase):
    """Splits the key list of each (query row, head block) over programs when there are too few
    rows to fill the GPU (decode: 640 keys, 4 head blocks), in one launch whose later programs
    combine the partials per (row, head) (flash-decoding; see the module docstring). Holds the
    workspace (partials and the self-clearing counters); one instance per device/stream, calls
    on it must not overlap."""

    def _workspace(self, device, slots: int, block_h: int, block_d: int, counters: int):
        key = (device, block_h, block_d)
        ws = self._ws.get(key)
        if ws is None or ws[1].shape[0] < slots or ws[2].numel() < counters:
            ws = (torch.empty(slots, block_h, block_d, dtype=torch.float32, device=device),
                  torch.empty(slots, 2, block_h, dtype=torch.float32, device=device),
                  torch.zeros(counters, dtype=torch.int32, device=device))
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
        per_min = cfg.pop("MIN_BLOCKS_PER_SPLIT")
        poll_ns = 0 if interpreting() else cfg.pop("POLL_NS", 0)
        h_blocks = triton.cdiv(h, cfg["BLOCK_H"])
        rows = b * s
        pairs = rows * h_blocks
        n_blocks = triton.cdiv(idx.shape[2], cfg["BLOCK_K"]) + triton.cdiv(t, cfg["BLOCK_K"])
        if n_split is None:  # split keys only until the grid covers the GPU twice
            n_split = max(1, min(triton.cdiv(n_blocks, per_min), triton.cdiv(2 * self._sms(q.device), pairs)))
        # a combine holds [NSP, BLOCK_D] partials in registers: at most 16K values
        n_split = min(n_split, max(1, 16384 // cfg["BLOCK_D"]))
        per = triton.cdiv(n_blocks, max(1, n_split))
        n_split = triton.cdiv(n_blocks, per)
        if n_split == 1:
            csa2_sparse_attention_kernel[(rows, h_blocks)](
                q, kv, idx, win, wmask, sink, s, kv.shape[1], t, idx.shape[2], out, H=h, D=d,
                SCALE=float(scale), num_stages=cfg.pop("num_stages", 3), **cfg)
            return out
        ws = self._workspace(q.device, pairs * n_split, cfg["BLOCK_H"], cfg["BLOCK_D"], 2 + 2 * pairs)
        # a split runs one key block: nothing for the software pipeline to overlap, and its
        # buffers cost time (H200 sweep at decode: 7.4 us unpipelined vs 8.7 us with 3 stages)
        stages = cfg.pop("num_stages", 1 if per == 1 else 3)
        one = cfg.pop("ONE_LAUNCH", ONE_LAUNCH_DEFAULT)
        splits = pairs * n_split
        roles = [(0, splits + rows * h)] if one else [(0, splits), (splits, rows * h)]
        for first_role, programs in roles:
            csa2_sparse_attention_split_kernel[(programs,)](
                q, kv, idx, win, wmask, sink, s, kv.shape[1], t, idx.shape[2], rows, per, n_split, first_role,
                out, *ws, H=h, D=d, SCALE=float(scale), NSP=next_pow2(n_split), num_stages=stages, ONE_LAUNCH=one,
                POLL_NS=poll_ns, **cfg)
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
