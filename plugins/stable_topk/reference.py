"""Stable top-k reference: the k best entries along the last axis, best first, ties to the lower
index (the release's stable sort, and ONNX TopK's rule). ReLU-weighted index scores tie exactly
(at 0) often, so the tie rule matters. Not a plugin op: in graphs it stays a standard sort/TopK.

Infinities (-inf for invisible entries, +inf for the pinned candidate block) are clamped to the
largest finite values for the sort only: same order, and ONNX Runtime's CUDA TopK mis-ordered
them against finite scores (scripts/compare_providers.py, 2026-12-02). The values come back from
the original scores.
"""

from __future__ import annotations

import torch


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) [..., min(k, N)]."""
    big = torch.finfo(scores.dtype).max
    _, idx = torch.sort(scores.clamp(-big, big), dim=-1, descending=True, stable=True)
    idx = idx[..., :k]  # slicing clips k to N
    return scores.gather(-1, idx), idx


def block_maxima(scores: torch.Tensor, block: int) -> torch.Tensor:
    """The block-max form's maxima (kernel.py, prefilter.py): [..., cdiv(N, block)], the largest
    of each run of `block` scores along the last axis, clamped to +-float32 max as the sort above
    clamps; a last partial block is padded with -float32 max. What an index kernel that scores a
    listed pool hands the top-k with its scores (csa2_index_score_pooled's `maxima_block`)."""
    if block < 1:
        raise ValueError(f"block_maxima: block must be >= 1, got {block}")
    big = torch.finfo(torch.float32).max
    n = scores.shape[-1]
    padded = torch.nn.functional.pad(scores.float().clamp(-big, big), (0, -n % block), value=-big)
    return padded.unflatten(-1, (-1, block)).amax(-1)
