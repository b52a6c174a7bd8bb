"""CSA2 building blocks as plain functions (ARCHITECTURE.md §4.3-4.5, Part B §5).

These are the reference semantics the plugin ops are checked against: compressor pooling over
groups of m rows, lightning-indexer scores, top-k with -1 padding, the hierarchical candidate
pool and sparse attention over window ∪ selected entries with a per-head sink.

Global entries of a KV source are addressed by their group index g (entry g pools rows
g*m .. g*m+m-1 and sits at position g*m); g = -1 marks an empty slot. Entry g is visible to a
query at position t iff 0 <= g < (t+1) // m.
"""

from __future__ import annotations

import torch


def pool_groups(u_BSD: torch.Tensor, z_BSD: torch.Tensor | None, state_u: torch.Tensor,
                state_z: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated pooling of each group of `ratio` consecutive rows ending at a new row.

    u/z: projections of the S new rows (fp32); state_u/state_z [B, ratio-1, D]: the last ratio-1
    rows before them, right-aligned (row seq_len-1 last). For each new row j the m rows ending at it
    are pooled with a per-channel softmax over z (ratio 1: the row itself). The result is only
    meaningful where the row completes a group; the caller masks the others.
    Returns (pooled [B, S, D], new state_u, new state_z): the state is the last ratio-1 rows.
    """
    if ratio == 1:
        return u_BSD, state_u, state_z
    s = u_BSD.shape[1]
    seq_u = torch.cat((state_u, u_BSD), dim=1)
    seq_z = torch.cat((state_z, z_BSD), dim=1)
    win_u = torch.stack([seq_u[:, i: i + s] for i in range(ratio)], dim=2)  # [B, S, m, D]
    win_z = torch.stack([seq_z[:, i: i + s] for i in range(ratio)], dim=2)
    pooled = (torch.softmax(win_z, dim=2) * win_u).sum(2)
    return pooled, seq_u[:, -(ratio - 1):], seq_z[:, -(ratio - 1):]


def completed_group(pos_BS: torch.Tensor, ratio: int) -> torch.Tensor:
    """Group index completed by each row (row t completes g = (t+1)/m - 1), else -1."""
    done = (pos_BS + 1) % ratio == 0
    return torch.where(done, (pos_BS + 1) // ratio - 1, torch.full_like(pos_BS, -1))


def visible_entries(group_BN: torch.Tensor, pos_BS: torch.Tensor, ratio: int) -> torch.Tensor:
    """[B, S, N] bool: entry n is visible to row s."""
    limit = ((pos_BS + 1) // ratio).unsqueeze(-1)
    g = group_BN.unsqueeze(1)
    return (g >= 0) & (g < limit)


def index_scores(q_BSIJ: torch.Tensor, w_BSI: torch.Tensor, k_BNJ: torch.Tensor,
                 visible_BSN: torch.Tensor) -> torch.Tensor:
    """I[b,s,n] = sum_i w[b,s,i] * relu(q[b,s,i] . k[b,n]); -inf where not visible. fp32."""
    dots = torch.einsum("bsij,bnj->bsin", q_BSIJ.float(), k_BNJ.float()).relu()
    scores = torch.einsum("bsin,bsi->bsn", dots, w_BSI.float())
    return scores.masked_fill(~visible_BSN, float("-inf"))


def select_topk(scores_BSN: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best entries, best first; -1 where fewer than k are visible."""
    vals, idx = stable_topk(scores_BSN, k)
    return torch.where(torch.isneginf(vals), torch.full_like(idx, -1), idx)


def stable_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last axis, best first, ties to the lower index (the release's stable sort,
    and ONNX TopK's rule). ReLU-weighted scores tie exactly (at 0) often, so this matters."""
    k = min(k, scores.shape[-1])
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def candidate_pool(scores_BSN: torch.Tensor, group_BN: torch.Tensor, pos_BS: torch.Tensor,
                   ratio: int, block: int, topk_blocks: int) -> torch.Tensor:
    """Hierarchical sparse indexer: keep the top blocks (of `block` consecutive groups) by their
    max score, always keeping the block of the newest visible entry. Returns a [B, S, N] mask."""
    b, s, n = scores_BSN.shape
    n_blocks = (n + block - 1) // block
    blk_BN = torch.where(group_BN >= 0, group_BN // block, torch.full_like(group_BN, n_blocks))
    blk = blk_BN.unsqueeze(1).expand(b, s, n)
    block_max = torch.full((b, s, n_blocks + 1), float("-inf"), dtype=scores_BSN.dtype,
                           device=scores_BSN.device)
    block_max = block_max.scatter_reduce(2, blk, scores_BSN, reduce="amax", include_self=True)
    newest = (pos_BS + 1) // ratio - 1
    has_newest = newest >= 0
    newest_blk = torch.where(has_newest, newest // block, torch.full_like(newest, n_blocks))
    pinned = torch.zeros_like(block_max, dtype=torch.bool).scatter(2, newest_blk.unsqueeze(-1), True)
    pinned[..., n_blocks] = False
    block_max = block_max.masked_fill(pinned, float("inf"))[..., :n_blocks]
    kb = min(topk_blocks, n_blocks)
    top_vals, top_blk = stable_topk(block_max, kb)
    keep = torch.zeros((b, s, n_blocks + 1), dtype=torch.bool, device=scores_BSN.device)
    keep = keep.scatter(2, top_blk, ~torch.isneginf(top_vals))
    return keep.gather(2, blk)


def sparse_attention(q_BSHD: torch.Tensor, kv_BND: torch.Tensor, idx_BSK: torch.Tensor,
                     win_kv_BTD: torch.Tensor, win_mask_BST: torch.Tensor, sink_H: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One softmax over the selected global entries and the window keys, with a per-head sink in
    the denominator only. K = V (MQA latent). fp32 maths; returns q's dtype."""
    q = q_BSHD.float()
    b, s, k = idx_BSK.shape
    sel = kv_BND.float().gather(1, idx_BSK.clamp_min(0).reshape(b, s * k, 1)
                                .expand(b, s * k, kv_BND.shape[-1])).view(b, s, k, -1)
    lg = torch.einsum("bshd,bskd->bshk", q, sel) * scale
    lg = lg.masked_fill((idx_BSK < 0).unsqueeze(2), float("-inf"))
    lw = torch.einsum("bshd,btd->bsht", q, win_kv_BTD.float()) * scale
    lw = lw.masked_fill(~win_mask_BST.unsqueeze(2), float("-inf"))
    logits = torch.cat((lg, lw), dim=-1)
    sink = sink_H.float().view(1, 1, -1, 1)
    m = torch.maximum(logits.amax(-1, keepdim=True), sink).clamp_min(-1e30)
    p = torch.exp(logits - m)
    denom = p.sum(-1, keepdim=True) + torch.exp(sink - m)
    p = p / denom
    out = torch.einsum("bshk,bskd->bshd", p[..., :k], sel)
    out = out + torch.einsum("bsht,btd->bshd", p[..., k:], win_kv_BTD.float())
    return out.to(q_BSHD.dtype)


def window_mask(win_pos_BT: torch.Tensor, pos_BS: torch.Tensor, window: int,
                start_B: torch.Tensor) -> torch.Tensor:
    """[B, S, T]: key at position p is in the window of query t iff max(start, t-W+1) <= p <= t."""
    p = win_pos_BT.unsqueeze(1)
    t = pos_BS.unsqueeze(-1)
    return (p >= start_B.view(-1, 1, 1)) & (p >= 0) & (p <= t) & (p > t - window)
