"""Stable top-k as one Triton launch (decode sizes: a few rows of up to 128K scores, k = 512).

Each score becomes a unique 64-bit key, (order-preserving bits of the score) << 32 | (2^32 - 1 -
index), so "largest key" means "best score, then lowest index" and no two keys tie: the stable
order of the reference, exactly. Grid (rows, chunks of CHUNK entries): each program takes the
bitonic top-K of its chunk's keys (tl.topk) into a workspace; the last program of a row (a
counter, as in the other launchers) takes the top-K of the P*K candidates, decodes indices and
values, and clears the counter. One chunk per row needs no workspace. Rows whose P*K exceeds
MERGE keys fall back to the reference (a sort) rather than a second launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsflash.plugins.launch import LauncherBase, check_device, check_dtype, next_pow2, require
from dsflash.plugins.stable_topk.reference import stable_topk as stable_topk_reference


@triton.jit
def _keys(scores, index):
    """Order-preserving uint64 keys: float order in the high word, reversed index in the low."""
    bits = scores.to(tl.uint32, bitcast=True)
    neg = (bits >> 31) != 0
    ordered = tl.where(neg, bits ^ 0xFFFFFFFF, bits | 0x80000000)  # ascending uint32 == ascending float
    return (ordered.to(tl.uint64) << 32) | (0xFFFFFFFF - index.to(tl.uint32)).to(tl.uint64)


@triton.jit
def _emit(top, row, k_out, vals_ptr, idx_ptr, K: tl.constexpr):
    """Decode sorted keys back to (value, index) and store the first k_out."""
    kk = tl.arange(0, K)
    ordered = (top >> 32).to(tl.uint32)
    neg = (ordered >> 31) == 0
    bits = tl.where(neg, ordered ^ 0xFFFFFFFF, ordered & 0x7FFFFFFF)
    vals = bits.to(tl.float32, bitcast=True)
    index = (0xFFFFFFFF - (top & 0xFFFFFFFF)).to(tl.int64)
    tl.store(vals_ptr + row * k_out + kk, vals, mask=kk < k_out)
    tl.store(idx_ptr + row * k_out + kk, index, mask=kk < k_out)


@triton.jit
def stable_topk_kernel(scores_ptr, N, k_out, vals_ptr, idx_ptr, ws, counter,
                       K: tl.constexpr, CHUNK: tl.constexpr, MERGE: tl.constexpr, SPLIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    n = p * CHUNK + tl.arange(0, CHUNK)
    s = tl.load(scores_ptr + row * N + n, mask=n < N, other=0.0)
    keys = tl.where(n < N, _keys(s, n), 0)  # padding sorts below every real key
    top = tl.topk(keys, K)
    if SPLIT:
        n_chunks = tl.num_programs(1)
        kk = tl.arange(0, K)
        tl.store(ws + (row * n_chunks + p) * K + kk, top)
        tl.debug_barrier()  # every thread's candidates are written before the counter moves
        done = tl.atomic_add(counter + row, 1)  # acq_rel at GPU scope
        if done == n_chunks - 1:
            m = tl.arange(0, MERGE)
            cand = tl.load(ws + row * n_chunks * K + m, mask=m < n_chunks * K, other=0,
                           cache_modifier=".cg")
            tl.store(counter + row, 0)  # cleared for the next launch
            _emit(tl.topk(cand, K), row, k_out, vals_ptr, idx_ptr, K)
    else:
        _emit(top, row, k_out, vals_ptr, idx_ptr, K)


class StableTopkLauncher(LauncherBase):
    """Holds the candidates workspace and the per-row counters; one instance per device/stream,
    calls on it must not overlap."""

    def __call__(self, scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        op = "StableTopk"
        check_dtype(op, "scores", scores, (torch.float32,))
        require(scores.dim() >= 1 and k >= 1, f"{op}: needs scores [..., N] and k >= 1, got "
                f"{tuple(scores.shape)} and k={k}")
        check_device(op, scores=scores)
        n = scores.shape[-1]
        k_out = min(k, n)
        lead = scores.shape[:-1]
        rows = scores.numel() // max(n, 1)
        big_k = next_pow2(k)
        chunk = self._overrides.get("CHUNK", max(8192, big_k))
        merge_max = self._overrides.get("MERGE", 8192)
        require(chunk >= big_k, f"{op}: chunk {chunk} is smaller than the padded k {big_k}")
        n_chunks = triton.cdiv(n, chunk)
        if n == 0 or rows == 0:
            return (scores.new_empty(*lead, 0), torch.empty(*lead, 0, dtype=torch.int64, device=scores.device))
        chunk = min(chunk, next_pow2(n, big_k)) if n_chunks == 1 else chunk
        if n_chunks * big_k > merge_max or n >= 2**31:
            return stable_topk_reference(scores, k)  # more candidates than one program merges
        flat = scores.contiguous().view(rows, n)
        vals = torch.empty(rows, k_out, dtype=torch.float32, device=scores.device)
        idx = torch.empty(rows, k_out, dtype=torch.int64, device=scores.device)
        split = n_chunks > 1
        if split:
            key = ("topk", scores.device)
            ws = self._ws.get(key)
            if ws is None or ws[0].numel() < rows * n_chunks * big_k or ws[1].numel() < rows:
                ws = (torch.empty(rows * n_chunks * big_k, dtype=torch.uint64, device=scores.device),
                      torch.zeros(rows, dtype=torch.int32, device=scores.device))
                self._ws[key] = ws
        else:
            ws = (vals, vals)  # never touched
        stable_topk_kernel[(rows, n_chunks)](flat, n, k_out, vals, idx, *ws, K=big_k, CHUNK=chunk,
                                             MERGE=next_pow2(n_chunks * big_k), SPLIT=split,
                                             num_warps=self._overrides.get("num_warps", 8))
        return vals.view(*lead, k_out), idx.view(*lead, k_out)


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's signature; a fresh launcher per call (hold a StableTopkLauncher to reuse
    its workspace)."""
    return StableTopkLauncher()(scores, k)
