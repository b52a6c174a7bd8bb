"""EngramHashGather reference: n-gram hash of compressed ids, then the table rows.

cids_BT: [B, look + S] int64, the lookback ids then the S new ids (-1 = before the start or a
dead token: it blocks every longer n-gram, sticky). Hash per row p, shift s = 0 .. look:
  t_s = pad if blocked else c[p - s];  rolling = t_0 m_0 ^ t_1 m_1 ^ ... (int64, no overflow)
  row(order s+1, head h) = rolling mod prime[(s-1) H + h] + offset[(s-1) H + h]
Columns are order-major (order 2 heads 0..H-1, then order 3, ...).
"""

from __future__ import annotations

import torch


def engram_hash_rows(cids_BT: torch.Tensor, multipliers: list[int], primes: list[int],
                     offsets: list[int], pad_id: int, heads: int) -> torch.Tensor:
    """Row ids [B, S, (len(multipliers)-1) * heads] int64 for the last S = T - look positions."""
    look = len(multipliers) - 1
    n_new = cids_BT.shape[1] - look
    cols, rolling, blocked = [], None, None
    for s in range(look + 1):
        tok = cids_BT[:, look - s: look - s + n_new]
        dead = tok < 0
        blocked = dead if blocked is None else blocked | dead
        t = torch.where(blocked, torch.full_like(tok, pad_id), tok)
        term = t * multipliers[s]
        rolling = term if rolling is None else torch.bitwise_xor(rolling, term)
        for h in range(heads if s > 0 else 0):
            j = (s - 1) * heads + h
            cols.append(torch.remainder(rolling, primes[j]) + offsets[j])
    return torch.stack(cols, dim=-1)


def engram_hash_gather(cids_BT: torch.Tensor, table_ND: torch.Tensor, multipliers: list[int],
                       primes: list[int], offsets: list[int], pad_id: int,
                       heads: int) -> torch.Tensor:
    """Gathered rows [B, S, (max_ngram-1) * heads, engram_dim]. Row ids are in range by
    construction (modulus + offset), so no bounds check is needed here."""
    rows = engram_hash_rows(cids_BT, multipliers, primes, offsets, pad_id, heads)
    return table_ND[rows]


def engram_hash_gather_fp8(cids_BT: torch.Tensor, table_ND: torch.Tensor, scales_N: torch.Tensor,
                           multipliers: list[int], primes: list[int], offsets: list[int], pad_id: int,
                           heads: int) -> torch.Tensor:
    """FP8 table rows with one fp32 scale per row (the released Engram storage): row * scale,
    rounded once to bf16."""
    rows = engram_hash_rows(cids_BT, multipliers, primes, offsets, pad_id, heads)
    return (table_ND[rows].float() * scales_N[rows].unsqueeze(-1)).to(torch.bfloat16)


def shape(cids_shape, table_shape, multipliers, primes, offsets, pad_id, heads):
    look = len(multipliers) - 1
    return [(cids_shape[0], cids_shape[1] - look, look * heads, table_shape[1])]
