"""CSA2 building blocks as plain functions (ARCHITECTURE.md §4.3-4.5, Part B §5).

Compressor pooling over groups of m rows, visibility, top-k with -1 padding (stable ties), the
hierarchical candidate pool and the window mask. The index scores and the sparse attention
themselves are custom ops (plugins/csa2_index_score, plugins/csa2_sparse_attention), called
through the model's OpSet.

Global entries of a KV source are addressed by their group index g (entry g pools rows
g*m .. g*m+m-1 and sits at position g*m); g = -1 marks an empty slot. Entry g is visible to a
query at position t iff 0 <= g < (t+1) // m.
"""

from __future__ import annotations

import torch

from dsflash.plugins.stable_topk.reference import stable_topk


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


def select_topk(scores_BSN: torch.Tensor, k: int, topk=stable_topk) -> torch.Tensor:
    """Indices of the k best entries, best first; -1 where fewer than k are visible. `topk` is
    the stable top-k in use (the reference, or the model's OpSet's kernel)."""
    vals, idx = topk(scores_BSN, k)
    return torch.where(torch.isneginf(vals), torch.full_like(idx, -1), idx)


def candidate_pool(scores_BSN: torch.Tensor, group_BN: torch.Tensor, pos_BS: torch.Tensor,
                   ratio: int, block: int, topk_blocks: int, topk=stable_topk) -> torch.Tensor:
    """Hierarchical sparse indexer: keep the top blocks (of `block` consecutive groups) by their
    max score, always keeping the block of the newest visible entry. Returns a [B, S, N] mask.

    Scores of invisible entries are -inf, so empty slots (group -1, counted in block 0 here)
    never raise a block's max; their own mask value is irrelevant (they are not visible).
    """
    b, s, n = scores_BSN.shape
    n_blocks = (n + block - 1) // block
    blk = (group_BN.clamp_min(0) // block).unsqueeze(1).expand(b, s, n)
    block_max = torch.full((b, s, n_blocks), float("-inf"), dtype=scores_BSN.dtype,
                           device=scores_BSN.device)
    block_max = block_max.scatter_reduce(2, blk, scores_BSN, reduce="amax", include_self=True)
    newest = (pos_BS + 1) // ratio - 1
    blocks = torch.arange(n_blocks, device=scores_BSN.device)
    pinned = (blocks == (newest // block).unsqueeze(-1)) & (newest >= 0).unsqueeze(-1)
    block_max = block_max.masked_fill(pinned, float("inf"))
    top_vals, top_blk = topk(block_max, topk_blocks)
    keep = torch.zeros_like(block_max, dtype=torch.bool).scatter(2, top_blk, ~torch.isneginf(top_vals))
    return keep.gather(2, blk)


def pool_entry_list(member_BSN: torch.Tensor, size: int) -> torch.Tensor:
    """The candidate pool as a list: ids of the entries in `member` (the pool's visible entries),
    ascending, -1 padded to `size` ([B, S, size] int32). Listed in index order, a stable top-k over
    the list breaks ties as one over all N entries does (lower id first), so select_listed_topk
    picks what select_topk picks from the masked scores.

    `size` = topk_blocks x block bounds the members: visible entries have distinct groups (group
    g sits at id g in the cache, a new row's group is past the cached ones), and only that many
    groups are in the kept blocks. Members past `size` would be dropped.

    Returned contiguous: every Reindex layer of the pool reads the list (its index kernel and its
    picks), and a view of the size + 1 columns would be copied by each of those launches (two
    4 MB copies a layer at 32 rows of a 16K pool, 5.7 us on an H100: docs/benchmarks.md, session 46).
    """
    b, s, n = member_BSN.shape
    rank = member_BSN.cumsum(-1, dtype=torch.int32) - 1
    slot = torch.where(member_BSN & (rank < size), rank, torch.full_like(rank, size))
    ids = torch.arange(n, dtype=torch.int32, device=member_BSN.device).expand(b, s, n)
    out = torch.full((b, s, size + 1), -1, dtype=torch.int32, device=member_BSN.device)
    return out.scatter_(2, slot.long(), ids)[..., :size].contiguous()


def select_listed_topk(scores_BSP: torch.Tensor, entries_BSP: torch.Tensor, k: int, n: int,
                       topk=stable_topk, picks=None) -> torch.Tensor:
    """select_topk over a listed pool (scores of the listed entries, -inf at padding), mapped back
    to entry ids; min(k, n) columns as select_topk over n entries gives, -1 past the pool.
    `topk` / `picks`: the top-k and listed_picks in use (the references, or an OpSet's kernels)."""
    vals, pos = topk(scores_BSP, k)
    if picks is None:  # not `picks or ...`: dynamo (torch 2.11) cannot branch on a bound method
        picks = listed_picks
    return picks(vals, pos, entries_BSP, min(k, n))


def listed_picks(vals_BSK: torch.Tensor, pos_BSK: torch.Tensor, entries_BSP: torch.Tensor,
                 width: int) -> torch.Tensor:
    """A top-k over a listed pool (values, list positions) as entry ids [B, S, width] int64: -1
    where the value is -inf (padding picked), where a position is outside the list, and in the
    columns past the top-k's."""
    p = entries_BSP.shape[-1]
    inside = (pos_BSK >= 0) & (pos_BSK < p)
    picked = entries_BSP.gather(2, pos_BSK.clamp(0, max(p - 1, 0))).long()
    idx = torch.where(torch.isneginf(vals_BSK) | ~inside, torch.full_like(picked, -1), picked)
    if idx.shape[-1] < width:
        idx = torch.nn.functional.pad(idx, (0, width - idx.shape[-1]), value=-1)
    return idx


def window_mask(win_pos_BT: torch.Tensor, pos_BS: torch.Tensor, window: int,
                start_B: torch.Tensor) -> torch.Tensor:
    """[B, S, T]: key at position p is in the window of query t iff max(start, t-W+1) <= p <= t."""
    p = win_pos_BT.unsqueeze(1)
    t = pos_BS.unsqueeze(-1)
    return (p >= start_B.view(-1, 1, 1)) & (p >= 0) & (p <= t) & (p > t - window)
