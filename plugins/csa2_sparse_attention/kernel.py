"""Csa2SparseAttention as a Triton kernel: each query row attends to its selected global entries
(gathered by index) and to its window keys in one online softmax, with the per-head sink in the
denominator. K = V (MQA latent), so every key row loaded serves all heads of a block.

Grid: (B * S query rows, head blocks of BLOCK_H, key splits). Keys stream through in blocks of
BLOCK_K: first the K selected entries (idx -1 = none, as is anything outside [0, N)), then the T
window keys (win_mask). With few rows (decode) the key blocks are split over programs (splits.py),
each writing its partial softmax (reference.csa2_sparse_attention_split), and a second small
kernel combines them per (row, head) (reference.csa2_attention_combine; flash-decoding), so the
whole GPU works on one token. bf16/fp16 operands go to the tensor cores
with fp32 accumulation (p is rounded to the operand dtype for the second product, as flash
attention does); fp32 operands use exact IEEE products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.aot import cdiv_expr as cdiv
from dsflash.plugins.csa2_sparse_attention import splits
from dsflash.plugins.launch import (
    FLOATS,
    LauncherBase,
    check_device,
    check_dtype,
    check_interpreter_dot,
    check_shape,
    interpreting,
    is_pow2,
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
def _prefetch_l2(ptrs, mask):
    """prefetch.global.L2 of the 128-byte line at each pointer where mask holds: a hint that
    returns at once, so the lines of later key blocks come from HBM while this program computes
    (the software pipeline's copies hold one block at a time in shared memory). No interpreter
    form: launchers pass PREFETCH=0 there."""
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; "
                              "@p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                              "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_keys(blk, last, row, b, N, T, K, sel_blocks, idx_ptr, kv_ptr, win_ptr, D: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, BLOCKS: tl.constexpr):
    """Prefetch key blocks blk .. blk + BLOCKS - 1 of a query row (selected blocks, then window
    blocks from sel_blocks on) into L2, one hint per 128-byte line, nothing from `last` on: one
    load of their entry ids, then the hints (a loop of one block at a time would wait for each
    block's ids in turn). Masks, no branches: it also sits in the pipelined loops."""
    LINE: tl.constexpr = 128 * 8 // kv_ptr.dtype.element_ty.primitive_bitwidth  # elements per line
    LINES: tl.constexpr = BLOCK_D // LINE if BLOCK_D > LINE else 1
    pos = blk * BLOCK_K + tl.arange(0, BLOCKS * BLOCK_K)  # key positions in the row's block list
    in_blk = pos // BLOCK_K
    line = tl.arange(0, LINES) * LINE
    line_ok = (line < D)[None, :]
    sel = tl.load(idx_ptr + row * K + pos, mask=(in_blk < last) & (pos < K), other=-1)
    sel_ok = (sel >= 0) & (sel < N)
    _prefetch_l2(kv_ptr + (b * N + sel[:, None]) * D + line[None, :], sel_ok[:, None] & line_ok)
    t = pos - sel_blocks * BLOCK_K
    win_ok = (in_blk < last) & (in_blk >= sel_blocks) & (t < T)
    _prefetch_l2(win_ptr + (b * T + t[:, None]) * D + line[None, :], win_ok[:, None] & line_ok)


@triton.jit
def csa2_sparse_attention_kernel(q_ptr, kv_ptr, idx_ptr, win_ptr, wmask_ptr, sink_ptr, S, N, T, K,
                                 blocks_per_split, out_ptr, acc_ptr, ml_ptr,
                                 H: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
                                 BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                                 SPLIT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False,
                                 PREFETCH: tl.constexpr = 0, INDEX_AHEAD: tl.constexpr = False,
                                 NORMED: tl.constexpr = False):
    # TensorRT's AOT order (inputs, integer scalars, outputs): the unsplit plugin passes out_ptr
    # (acc_ptr / ml_ptr compiled as None), the split plugin acc_ptr [B,S,P,H,D] and ml_ptr
    # [B,S,P,2,H] (out_ptr None). Contiguous tensors, so strides follow from the sizes; the
    # softmax scale is a compile-time constant (an attribute).
    # INDEX_AHEAD: the selected loop loads the next block's entry ids one step ahead into
    # registers. Loaded in the step that uses them, Triton's software pipeline copies the ids
    # and the rows they point at asynchronously and waits for every copy at the top of each step
    # (sm_90 TTGIR: async_wait num = 0 at any num_stages), so the gather of block i + 1
    # overlaps block i's last product only; carried ahead, the ids are plain loads and the wait
    # leaves num_stages - 2 row copies in flight (num = 2 at 4 stages), as in the window loop.
    # PREFETCH > 0 (a power of two): the first PREFETCH key blocks are hinted into L2 before the
    # loops and each step hints the block PREFETCH ahead (_prefetch_keys), so more of the gather
    # is in flight than the shared-memory stages hold.
    # NORMED (split form): each partial divided by its own sum, in acc_ptr's dtype (the operands':
    # in 16 bits half the fp32 partial's bytes out and into the combine;
    # csa2_attention_combine_normed reads them).
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
    sel_end = tl.minimum(last, sel_blocks)
    if PREFETCH > 0:
        _prefetch_keys(first, last, b * S + s, b, N, T, K, sel_blocks, idx_ptr, kv_ptr, win_ptr, D,
                       BLOCK_K, BLOCK_D, PREFETCH)
    if INDEX_AHEAD:
        k = first * BLOCK_K + kk
        sel_next = tl.load(idx_ptr + (b * S + s) * K + k, mask=(k < K) & (first < sel_end), other=-1)
    for blk in range(first, sel_end):
        if PREFETCH > 0:
            _prefetch_keys(blk + PREFETCH, last, b * S + s, b, N, T, K, sel_blocks, idx_ptr, kv_ptr,
                           win_ptr, D, BLOCK_K, BLOCK_D, 1)
        if INDEX_AHEAD:
            sel = sel_next
            k = (blk + 1) * BLOCK_K + kk
            sel_next = tl.load(idx_ptr + (b * S + s) * K + k, mask=(k < K) & (blk + 1 < sel_end), other=-1)
        else:
            k = blk * BLOCK_K + kk
            sel = tl.load(idx_ptr + (b * S + s) * K + k, mask=k < K, other=-1)
        valid = (sel >= 0) & (sel < N)  # idx -1 = none, as is anything outside [0, N)
        kv = tl.load(kv_ptr + (b * N + sel[:, None]) * D + dd[None, :],
                     mask=valid[:, None] & dmask[None, :], other=0.0)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, kv, valid, SCALE, IEEE)
    for blk in range(tl.maximum(first, sel_blocks), last):
        if PREFETCH > 0:
            _prefetch_keys(blk + PREFETCH, last, b * S + s, b, N, T, K, sel_blocks, idx_ptr, kv_ptr,
                           win_ptr, D, BLOCK_K, BLOCK_D, 1)
        t = (blk - sel_blocks) * BLOCK_K + kk
        valid = tl.load(wmask_ptr + (b * S + s) * T + t, mask=t < T, other=0) != 0
        kv = tl.load(win_ptr + (b * T + t[:, None]) * D + dd[None, :],
                     mask=valid[:, None] & dmask[None, :], other=0.0)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, kv, valid, SCALE, IEEE)
    if SPLIT:  # partial softmax of this run of keys, for the combine kernel
        part = (row * tl.num_programs(2) + tl.program_id(2)) * H + h  # [B*S, P, H] flat
        if NORMED:  # a split that saw no key has l = 0: zeros, weighted 0 by the combine
            acc = acc * tl.where(l_i > 0, 1.0 / l_i, 0.0)[:, None]
        tl.store(acc_ptr + part[:, None] * D + dd[None, :], acc.to(acc_ptr.dtype.element_ty), mask=hd_mask)
        # m and l as two planes of H: 16 heads' values in one contiguous store each (interleaved
        # (m, l) pairs cost 0.35 us more per decode step on the H200, 7.13 against 6.78 us)
        plane = (row * tl.num_programs(2) + tl.program_id(2)) * 2 * H + h
        tl.store(ml_ptr + plane, m_i, mask=hmask)
        tl.store(ml_ptr + plane + H, l_i, mask=hmask)
    else:
        out = acc / (l_i + tl.exp(sink - m_i))[:, None]
        out_ptrs = out_ptr + ((b * S + s) * H + h[:, None]) * D + dd[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=hd_mask)


@triton.jit
def csa2_attention_combine_kernel(q_ptr, acc_ptr, ml_ptr, sink_ptr, n_split, out_ptr, H: tl.constexpr,
                                  D: tl.constexpr, BLOCK_D: tl.constexpr, NSP: tl.constexpr,
                                  PDL: tl.constexpr = False, CHUNK: tl.constexpr = 4,
                                  NORMED: tl.constexpr = False):
    """Grid (query rows, heads): the n_split partial softmaxes of one head, weighted by
    exp(m_p - m) and normalised with the sink: the maxima and sums in one load each (NSP >=
    n_split), the outputs in chunks of CHUNK splits (a power of two <= NSP). q_ptr is the combine
    plugin's first input, which gives the output its dtype; it is not read. NORMED: each partial
    was divided by its own sum l_p (either split form's NORMED_PARTS partials, in the operands'
    dtype), so its weight is exp(m_p - m) l_p.

    The JIT launch knows n_split and loads every split in one chunk. The AOT kernel serves any
    n_split up to splits.max_splits (NSP 32 at 512 dims), and one [32, 512] chunk takes 162
    registers a thread (3 programs an SM) with every row's loads issued, live or not: at 128 rows
    of one split the Gluon split node with this combine took 79.7 us against 57.5 in chunks of 4
    (H100, bench_aot.py, one call, 2026-12-06), while one row of 21 splits (split tactic 1) took
    8.1 against 8.9. So TensorRT times both (trt_split.combine_tactics)."""
    wait_for_earlier_grids(PDL)
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    sp = tl.arange(0, NSP)
    plane = (row * n_split + sp) * 2 * H + h
    m_p = tl.load(ml_ptr + plane, mask=sp < n_split, other=float("-inf"))
    l_p = tl.load(ml_ptr + plane + H, mask=sp < n_split, other=0.0)
    sink = tl.load(sink_ptr + h).to(tl.float32)
    m_all = tl.maximum(sink, tl.max(m_p, axis=0))
    denom = tl.sum(tl.exp(m_p - m_all) * l_p, axis=0) + tl.exp(sink - m_all)  # exp(-inf) = 0: absent splits
    dd = tl.arange(0, BLOCK_D)
    cc = tl.arange(0, CHUNK)
    out = tl.zeros([BLOCK_D], dtype=tl.float32)
    for first in range(0, n_split, CHUNK):
        part_row = row * n_split + first + cc
        live = first + cc < n_split
        w = tl.exp(tl.load(ml_ptr + part_row * 2 * H + h, mask=live, other=float("-inf")) - m_all)
        if NORMED:
            w = w * tl.load(ml_ptr + part_row * 2 * H + H + h, mask=live, other=0.0)
        part = tl.load(acc_ptr + (part_row * H + h)[:, None] * D + dd[None, :],
                       mask=live[:, None] & (dd < D)[None, :], other=0.0).to(tl.float32)
        out += tl.sum(w[:, None] * part, axis=0)
    tl.store(out_ptr + (row * H + h) * D + dd, (out / denom).to(out_ptr.dtype.element_ty), mask=dd < D)


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
    check_interpreter_dot(op, q=q_BSHD)  # kv and win_kv share its dtype


class SparseAttentionLauncher(LauncherBase):
    """Splits the key list of each (query row, head block) over programs when there are too few
    rows to fill the GPU (decode: 640 keys, 4 head blocks; splits.py): each program writes its
    partial softmax to a workspace and a second, small launch combines them per (row, head), in
    parallel over heads (flash-decoding). A merge inside the first launch (the last program of a
    pair reading every partial, 32 KB each at head_dim 512) serialised on one program and cost
    more than the second launch (docs/benchmarks.md). Holds the workspace; one instance per
    device/stream, calls on it must not overlap."""

    # the override names the launcher reads: launch_config's entries, the pipeline depth, the
    # gather options, PDL and the Gluon choice (attention_ablation.py --attn-over checks against it)
    OVERRIDES = frozenset({"BLOCK_H", "BLOCK_K", "BLOCK_D", "IEEE", "num_warps", "num_stages", "INDEX_AHEAD",
                           "PREFETCH", "PDL", "GLUON", "GLUON_KB", "GLUON_STAGES", "NORMED_PARTS"})
    # overrides either form takes alike: with only these set, the launch still picks its form
    FORM_NEUTRAL = frozenset({"PDL", "NORMED_PARTS"})

    def _workspace(self, device, parts: int, dim: int, dtype: torch.dtype = torch.float32):
        """(acc [parts * dim] in `dtype`, ml [parts * 2] in fp32), at least that large."""
        cap = next_pow2(parts)
        return self._reuse_or_make(
            (device, dim, dtype), lambda ws: ws[1].numel() >= 2 * parts,
            lambda: (torch.empty(cap * dim, dtype=dtype, device=device),
                     torch.empty(cap * 2, dtype=torch.float32, device=device)))

    def _config(self, q: torch.Tensor) -> tuple[dict, dict]:
        b, s, h, d = q.shape
        cfg = launch_config(h, d, q.dtype, rows=b * s) | self._overrides
        ahead = cfg.get("PREFETCH", 0)
        require(is_pow2(ahead, zero_ok=True), f"Csa2SparseAttention: PREFETCH {ahead!r} must be 0 or a power "
                f"of two (key blocks hinted ahead)")
        require(isinstance(cfg.get("INDEX_AHEAD", False), bool),
                f"Csa2SparseAttention: INDEX_AHEAD {cfg.get('INDEX_AHEAD')!r} must be True or False")
        require(isinstance(cfg.get("NORMED_PARTS", False), bool),
                f"Csa2SparseAttention: NORMED_PARTS {cfg.get('NORMED_PARTS')!r} must be True or False")
        # the default; a sweep of Triton settings (any override but the form-neutral ones) stays
        # Triton
        if not set(self._overrides) - self.FORM_NEUTRAL:
            cfg["GLUON"] = (splits.gluon_form(h, d, b * s, ieee=q.dtype == torch.float32)
                            and _gluon_problem(q) is None)
        gluon_keys = {"GLUON_KB", "GLUON_STAGES"} & set(self._overrides)
        require(not gluon_keys or cfg.get("GLUON", False),
                f"Csa2SparseAttention: {sorted(gluon_keys)} set the Gluon form's blocks, "
                f"but GLUON is not True")
        if cfg.get("GLUON", False):
            _check_gluon(q)
            cfg |= {"GLUON_KB": cfg.get("GLUON_KB", gluon_block_keys()),
                    "GLUON_STAGES": cfg.get("GLUON_STAGES", GLUON_STAGES)}
            check_gluon_blocks(h, d, q.dtype, cfg["GLUON_KB"], cfg["GLUON_STAGES"])
            cfg["BLOCK_K"] = cfg["GLUON_KB"]
        if interpreting():  # the L2 hint is inline PTX, which the interpreter cannot run
            require("PREFETCH" not in self._overrides or ahead == 0,
                    f"Csa2SparseAttention: PREFETCH {ahead} needs a GPU; the interpreter runs 0 only")
            cfg["PREFETCH"] = 0
        return cfg, pdl_launch_args(q.device, {"PDL": cfg.pop("PDL", True)})

    def __call__(self, q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H, scale: float,
                 n_split: int | None = None):
        _check(q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H)
        b, s, h, d = q_BSHD.shape
        out = torch.empty_like(q_BSHD)
        if out.numel() == 0:
            return out
        cfg, pdl = self._config(q_BSHD)
        gluon = cfg.get("GLUON", False)  # all heads in one program at any row count
        attn_pdl = gluon_launch_pdl(self._overrides, q_BSHD.device) if gluon else pdl
        head_blocks = 1 if gluon else cdiv(h, cfg["BLOCK_H"])
        target = cdiv(2 * self._sms(q_BSHD.device), head_blocks)
        batch = gluon or splits.batch_form(h, d, b * s, ieee=q_BSHD.dtype == torch.float32)
        if n_split is None and gluon:
            n_split = splits.gluon_split_count(b * s, self._sms(q_BSHD.device))
        elif n_split is None and batch and head_blocks == 1:  # all heads in one program (also in sweeps)
            n_split = splits.split_count(b * s, head_blocks, self._sms(q_BSHD.device))
        per, n_split = splits.split_plan(b * s, idx_BSK.shape[2], win_kv_BTD.shape[1], d, cfg["BLOCK_K"],
                                         target, n_split)
        if n_split == 1:
            _launch_attention(q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H, scale, cfg,
                              attn_pdl, per, 1, (out, None, None))
            return out
        normed = cfg.get("NORMED_PARTS", False)
        acc, ml = self._workspace(q_BSHD.device, b * s * n_split * h, d,
                                  q_BSHD.dtype if normed else torch.float32)
        _launch_attention(q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H, scale, cfg,
                          attn_pdl, per, n_split, (None, acc, ml))
        _launch_combine(q_BSHD, acc, ml, sink_H.contiguous(), n_split, out, pdl, normed)
        return out


def gluon_launch_pdl(overrides: dict, device: torch.device) -> dict:
    """The Gluon form's PDL launch arguments (as pdl_launch_args'): off unless `overrides` set PDL
    to True, where the Triton kernels and the combine after either form launch with PDL by default.
    Why: on an H100 (session 52, docs/benchmarks.md) the Gluon attention launched with PDL took
    2.3-3.2 us longer at 16-24 rows in 3-4 splits, and gained nothing beyond noise elsewhere."""
    return pdl_launch_args(device, {"PDL": overrides.get("PDL") is True})


def gluon_shape_problem(heads: int, dim: int, dtype: torch.dtype) -> str | None:
    """Why the warp-specialized batch form (gluon_batch.py) cannot take `heads` x `dim` in `dtype`,
    or None: 64 heads (one 64-row wgmma) of 64, 128, 256 or 512 dims, bf16 or fp16. Gluon's
    tensors and shared-memory tiles have power-of-two shapes, so 192 or 384 dims do not compile:
    the Triton batch form takes those (its BLOCK_D rounds up and masks)."""
    if heads != 64:
        return f"GLUON takes 64 heads (one 64-row wgmma), got {heads}"
    if not (is_pow2(dim) and 64 <= dim <= 512):
        return f"GLUON takes head_dim 64, 128, 256 or 512 (Gluon's tiles are powers of two), got {dim}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"GLUON takes bf16 or fp16, got {dtype}"
    return None


def _gluon_problem(q: torch.Tensor) -> str | None:
    """gluon_shape_problem for q, or why its device cannot run the kernel (it needs an sm_90
    GPU), or None."""
    if interpreting():
        return "GLUON needs a GPU (Gluon kernels have no interpreter form)"
    problem = gluon_shape_problem(q.shape[2], q.shape[3], q.dtype)
    if problem is not None:
        return problem
    cap = torch.cuda.get_device_capability(q.device)
    if cap != (9, 0):
        return f"GLUON is written for sm_90 (wgmma, setmaxnreg), this GPU is sm_{cap[0]}{cap[1]}"
    return None


def _check_gluon(q: torch.Tensor) -> None:
    problem = _gluon_problem(q)
    require(problem is None, f"Csa2SparseAttention: {problem}")


def gluon_block_keys() -> int:
    """Keys per block of the warp-specialized form: 64 (a 64-column logits wgmma; two 64 KB
    stages of 512-dim rows beside Q's 64 KB)."""
    return 64


# the Gluon form's key stages by default (gluon_block_keys' blocks); GLUON_KB / GLUON_STAGES
# override both, e.g. 32-key blocks in 4 stages: the refill of a freed stage then has three blocks
# of work to land behind instead of one (session 35's timeline: the two-stage cycle is 1.97 us
# per 64-key block, H100, where shared memory allows 1.07). Timed in session 39 (H100): slower
# from 12 rows (64 rows 34.0 / 33.1 us in 4 / 3 stages against 27.8), as each 32-key block costs
# 1.25 us; so the default stays
GLUON_STAGES = 2
# the shared memory one sm_90 program may hold (227 KB; CUDA C++ Programming Guide, compute
# capability 9.0 table: maximum shared memory per thread block)
SM90_SHARED_BYTES = 232448


def gluon_shared_bytes(heads: int, dim: int, itemsize: int, block_keys: int, stages: int) -> int:
    """Shared memory of one Gluon program (gluon_batch.py): Q [H, D], the key stages
    [STAGES, KB, D] and p's double buffer [2, H, KB] in 16-bit, the fp32 rescale factors and the
    softmax statistics [2, H] each, the barriers, and 1 KB for the compiler's own scratch (the
    sm_90 compile at 64 heads x 512 takes 214,300 bytes in 64-key blocks x 2 stages and 206,124
    in 32-key blocks x 4, 228-232 over the tiles and barriers)."""
    tiles = itemsize * (heads * dim + stages * block_keys * dim + 2 * heads * block_keys)
    return tiles + 2 * 2 * heads * 4 + 8 * (stages + 5) + 1024


def check_gluon_blocks(heads: int, dim: int, dtype: torch.dtype, block_keys: int, stages: int) -> None:
    """GLUON_KB / GLUON_STAGES the kernel can take: 32- or 64-key blocks (the logits wgmma's
    columns), 2 to 4 stages that together hold the [H, D] result for its store (stages x keys >=
    heads), within an sm_90 program's shared memory."""
    require(block_keys in (32, 64), f"Csa2SparseAttention: GLUON_KB must be 32 or 64, got {block_keys!r}")
    require(stages in (2, 3, 4), f"Csa2SparseAttention: GLUON_STAGES must be 2, 3 or 4, got {stages!r}")
    require(stages * block_keys >= heads,
            f"Csa2SparseAttention: GLUON_STAGES x GLUON_KB = {stages * block_keys} keys must reach the "
            f"{heads} heads (the stages hold the result for its store)")
    need = gluon_shared_bytes(heads, dim, dtype.itemsize, block_keys, stages)
    require(need <= SM90_SHARED_BYTES,
            f"Csa2SparseAttention: GLUON_KB {block_keys} in {stages} stages needs {need} bytes of shared "
            f"memory at {heads} heads x {dim}, over the {SM90_SHARED_BYTES} an sm_90 program may hold")


def _launch_attention(q, kv, idx, win, wmask, sink, scale, cfg, pdl, per, n_split, outs):
    """One launch of csa2_sparse_attention_kernel: (out, None, None) unsplit, (None, acc, ml) split
    (acc in the operands' dtype with cfg's NORMED_PARTS: each partial divided by its sum)."""
    b, s, h, d = q.shape
    t = win.shape[1]
    cfg = dict(cfg)
    split = outs[0] is None
    normed = cfg.pop("NORMED_PARTS", False) and split  # an unsplit launch has no partials
    if cfg.pop("GLUON", False):
        _launch_gluon(q, kv, idx, win, wmask, sink, scale, per, n_split, outs, cfg["GLUON_KB"],
                      cfg["GLUON_STAGES"], pdl, normed)
        return
    # a split runs one key block: nothing for the software pipeline to overlap, and its
    # buffers cost time (H200 sweep at decode: 7.4 us unpipelined vs 8.7 us with 3 stages)
    stages = cfg.pop("num_stages", 1 if split and per == 1 else 3)
    out, acc, ml = outs
    some = next(x for x in outs if x is not None)
    csa2_sparse_attention_kernel[(b * s, cdiv(h, cfg["BLOCK_H"]), n_split)](
        q.contiguous(), kv.contiguous(), idx.contiguous(), win.contiguous(),
        wmask.contiguous().view(torch.uint8), sink.contiguous(), s, kv.shape[1], t, idx.shape[2], per,
        some if out is None else out, some if acc is None else acc, some if ml is None else ml,
        H=h, D=d, SCALE=float(scale), SPLIT=split, NORMED=normed, num_stages=stages, **cfg, **pdl)


def _launch_gluon(q, kv, idx, win, wmask, sink, scale, per, n_split, outs, block_keys: int, stages: int,
                  pdl: dict, normed: bool):
    """One launch of gluon_batch.csa2_sparse_attention_ws_kernel (8 + 4 warps, maxnreg 168) in
    `stages` stages of `block_keys` keys; `pdl` as the Triton kernel's (pdl_launch_args); `normed`:
    16-bit partials, each divided by its sum."""
    from dsflash.plugins.csa2_sparse_attention import gluon_batch

    b, s, h, d = q.shape
    out, acc, ml = outs
    some = next(x for x in outs if x is not None)
    gluon_batch.csa2_sparse_attention_ws_kernel[(b * s, 1, n_split)](
        q.contiguous(), kv.contiguous(), idx.contiguous(), win.contiguous(),
        wmask.contiguous().view(torch.uint8), sink.contiguous(), s, kv.shape[1], win.shape[1],
        idx.shape[2], per, some if out is None else out, some if acc is None else acc,
        some if ml is None else ml, H=h, D=d, SCALE=float(scale), KB=block_keys, STAGES=stages,
        SPLIT=out is None, NORMED=normed, num_warps=8, maxnreg=gluon_batch.MAXNREG, **pdl)


def _launch_combine(q, acc, ml, sink, n_split: int, out, pdl, normed: bool = False):
    b, s, h, d = q.shape
    # every split in one chunk: the launch knows n_split, so NSP fits it (the AOT kernel cannot)
    csa2_attention_combine_kernel[(b * s, h)](q, acc, ml, sink, n_split, out, H=h, D=d,
                                              BLOCK_D=next_pow2(d, 16), NSP=next_pow2(n_split),
                                              CHUNK=next_pow2(n_split), NORMED=normed, num_warps=4, **pdl)


def csa2_sparse_attention(q_BSHD: torch.Tensor, kv_BND: torch.Tensor, idx_BSK: torch.Tensor,
                          win_kv_BTD: torch.Tensor, win_mask_BST: torch.Tensor, sink_H: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """The reference's signature; a fresh launcher (and workspace) per call. Hold a
    SparseAttentionLauncher to reuse the workspace."""
    return SparseAttentionLauncher()(q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H, scale)


def csa2_sparse_attention_split(q_BSHD: torch.Tensor, kv_BND: torch.Tensor, idx_BSK: torch.Tensor,
                                win_kv_BTD: torch.Tensor, win_mask_BST: torch.Tensor, sink_H: torch.Tensor,
                                scale: float, block_keys: int, split_target: int
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The split form's first node (reference.csa2_sparse_attention_split's signature): the
    partials in fresh [B,S,P,H,D] / [B,S,P,2,H] fp32 tensors. block_keys is the kernel's BLOCK_K."""
    _check(q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H)
    require(block_keys in (16, 32, 64, 128), f"Csa2SparseAttentionSplit: block_keys {block_keys} is not "
            f"one of the kernel's key blocks (16, 32, 64, 128)")
    b, s, h, d = q_BSHD.shape
    per, n_split = splits.split_plan(b * s, idx_BSK.shape[2], win_kv_BTD.shape[1], d, block_keys,
                                     split_target)
    acc = q_BSHD.new_empty((b, s, n_split, h, d), dtype=torch.float32)
    ml = q_BSHD.new_empty((b, s, n_split, 2, h), dtype=torch.float32)
    if acc.numel():
        cfg = launch_config(h, d, q_BSHD.dtype) | {"BLOCK_K": block_keys}
        _launch_attention(q_BSHD, kv_BND, idx_BSK, win_kv_BTD, win_mask_BST, sink_H, scale, cfg,
                          pdl_launch_args(q_BSHD.device, {}), per, n_split, (None, acc, ml))
    return acc, ml


def csa2_attention_combine(q_BSHD: torch.Tensor, acc_BSPHD: torch.Tensor, ml_BSP2H: torch.Tensor,
                           sink_H: torch.Tensor) -> torch.Tensor:
    """The split form's second node (reference.csa2_attention_combine's signature)."""
    return _combine("Csa2AttentionCombine", q_BSHD, acc_BSPHD, ml_BSP2H, sink_H, normed=False)


def csa2_attention_combine_normed(q_BSHD: torch.Tensor, parts_BSPHD: torch.Tensor, ml_BSP2H: torch.Tensor,
                                  sink_H: torch.Tensor) -> torch.Tensor:
    """reference.csa2_attention_combine_normed's signature: the partials each divided by its own
    sum, in q's dtype (what SparseAttentionLauncher's NORMED_PARTS split form writes)."""
    return _combine("Csa2AttentionCombine (normed partials)", q_BSHD, parts_BSPHD, ml_BSP2H, sink_H,
                    normed=True)


def _combine(op: str, q_BSHD, acc_BSPHD, ml_BSP2H, sink_H, normed: bool) -> torch.Tensor:
    check_shape(op, "q", q_BSHD, (None, None, None, None))
    b, s, h, d = q_BSHD.shape
    check_shape(op, "acc", acc_BSPHD, (b, s, None, h, d))
    n_split = acc_BSPHD.shape[2]
    check_shape(op, "ml", ml_BSP2H, (b, s, n_split, 2, h))
    check_shape(op, "sink", sink_H, (h,))
    check_dtype(op, "ml", ml_BSP2H, (torch.float32,))
    check_dtype(op, "q", q_BSHD, FLOATS)
    check_dtype(op, "sink", sink_H, FLOATS)
    if normed:
        check_dtype(op, "acc", acc_BSPHD, (q_BSHD.dtype,))
    else:
        check_dtype(op, "acc", acc_BSPHD, (torch.float32,))
    require(1 <= n_split <= splits.max_splits(d), f"{op}: {n_split} splits; the kernel combines 1 to "
            f"{splits.max_splits(d)} at head_dim {d}")
    check_device(op, q=q_BSHD, acc=acc_BSPHD, ml=ml_BSP2H, sink=sink_H)
    out = torch.empty_like(q_BSHD)
    if out.numel():
        _launch_combine(q_BSHD, acc_BSPHD.contiguous(), ml_BSP2H.contiguous(), sink_H.contiguous(), n_split,
                        out, pdl_launch_args(q_BSHD.device, {}), normed)
    return out


def launch_config(heads: int, dim: int, dtype: torch.dtype, rows: int | None = None) -> dict:
    """splits.launch_config for a dtype (fp32 operands take exact IEEE products) and, in a JIT
    launch, the number of query rows (B*S)."""
    return splits.launch_config(heads, dim, ieee=dtype == torch.float32, rows=rows)
