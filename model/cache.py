"""The reference model's cache: the state of PIPELINE.md §3 for `batch` slots and `capacity` tokens.

  swa_kv              [L, B, W, D]     window ring of every layer, slot = position mod W
  kv.<src>            [B, C/m, D]      compressed global KV of each KV source (ratio m)
  index_k.<src>       [B, C/m, J]      indexer keys of each KV source
  comp_kv.<src>       [B, m-1, D] fp32 pending rows of a partial group (m > 1), right-aligned
  comp_score.<src>    [B, m-1, D] fp32 their gate scores
  engram_hist         [B, n-1] int64   the last n-1 token ids (-1 before the sequence start)
  seq_len             [B] int64        tokens already in the cache
  replay_start        [B] int64        first position whose decoder-layer window rows exist
                                       (bounded replay: decoder windows start there)
Graph steps do not write the cache; they return additions, and `write` puts them in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsflash.model.config import ModelConfig


@dataclass(frozen=True)
class StateSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: float  # value of an empty slot


def state_specs(cfg: ModelConfig, batch: int, capacity: int, dtype: torch.dtype) -> list[StateSpec]:
    d, j = cfg.head_dim, cfg.index_head_dim
    specs = [StateSpec("swa_kv", (cfg.num_hidden_layers, batch, cfg.sliding_window, d), dtype, 0.0)]
    for src in cfg.kv_source_layer_ids:
        m = cfg.layer_ratio(src)
        specs.append(StateSpec(f"kv.{src}", (batch, capacity // m, d), dtype, 0.0))
        specs.append(StateSpec(f"index_k.{src}", (batch, capacity // m, j), dtype, 0.0))
        if m > 1:
            specs.append(StateSpec(f"comp_kv.{src}", (batch, m - 1, d), torch.float32, 0.0))
            specs.append(StateSpec(f"comp_score.{src}", (batch, m - 1, d), torch.float32, 0.0))
    specs.append(StateSpec("engram_hist", (batch, cfg.engram_max_ngram_size - 1), torch.int64, -1))
    specs.append(StateSpec("seq_len", (batch,), torch.int64, 0))
    specs.append(StateSpec("replay_start", (batch,), torch.int64, 0))
    return specs


class ModelCache:
    """Preallocated state for `batch` slots; each slot holds one sequence of <= capacity tokens."""

    def __init__(self, cfg: ModelConfig, capacity: int, tensors: dict[str, torch.Tensor]):
        self.cfg, self.capacity, self.tensors = cfg, capacity, tensors

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, capacity: int, device="cpu",
                 dtype: torch.dtype = torch.float32) -> "ModelCache":
        if batch <= 0:
            raise ValueError(f"batch={batch} must be > 0")
        if not 0 < capacity <= cfg.max_position_embeddings:
            raise ValueError(f"capacity={capacity} must be in [1, max_position_embeddings="
                             f"{cfg.max_position_embeddings}]")
        tensors = {s.name: torch.full(s.shape, s.fill, dtype=s.dtype, device=device)
                   for s in state_specs(cfg, batch, capacity, dtype)}
        return cls(cfg, capacity, tensors)

    @property
    def batch(self) -> int:
        return self.tensors["seq_len"].shape[0]

    @property
    def seq_len(self) -> torch.Tensor:
        return self.tensors["seq_len"]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def slot_index(self, slots) -> torch.Tensor:
        device = self.seq_len.device
        if slots is None:
            return torch.arange(self.batch, device=device)
        idx = torch.as_tensor(slots, dtype=torch.int64, device=device).reshape(-1)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.batch):
            raise ValueError(f"slot ids {idx.tolist()} outside [0, {self.batch})")
        if idx.unique().numel() != idx.numel():
            raise ValueError(f"slot ids {idx.tolist()} contain duplicates")
        return idx

    def reset(self, slots=None) -> None:
        """Empty the given slots (stale values in rings and entries are masked by seq_len)."""
        idx = self.slot_index(slots)
        self.tensors["seq_len"][idx] = 0
        self.tensors["replay_start"][idx] = 0
        self.tensors["engram_hist"][idx] = -1

    def check_room(self, idx: torch.Tensor, new_rows: int) -> None:
        lens = self.seq_len[idx]
        need = int(lens.max()) + new_rows if lens.numel() else new_rows
        if need > self.capacity:
            raise ValueError(f"sequence would reach {need} tokens, over the cache capacity "
                             f"{self.capacity}")

    def gather(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state of the selected slots (batch axis first except the per-layer ring)."""
        out = {k: (v[:, idx] if k == "swa_kv" else v[idx]) for k, v in self.tensors.items()}
        return out

    def write(self, adds: dict, idx: torch.Tensor) -> None:
        """Put a step's additions in place for slots idx (rows of `adds` follow idx's order)."""
        t, w = self.tensors, self.cfg.sliding_window
        rows = adds["swa_rows"]  # [Lr, b, S, D] for layers first_layer .. first_layer+Lr-1
        first = adds["swa_first_layer"]
        pos = adds["pos"]  # [b, S]
        keep = min(rows.shape[2], w)  # only the last W rows can survive in the ring
        ring_slot = (pos[:, -keep:] % w)
        for li in range(rows.shape[0]):
            ring = t["swa_kv"][first + li]
            sub = ring[idx]
            sub.scatter_(1, ring_slot.unsqueeze(-1).expand(-1, -1, rows.shape[-1]),
                         rows[li, :, -keep:].to(sub.dtype))
            ring[idx] = sub
        for src in self.cfg.kv_source_layer_ids:
            if f"group.{src}" not in adds:
                continue
            group = adds[f"group.{src}"]
            b_i, s_i = torch.nonzero(group >= 0, as_tuple=True)
            g = group[b_i, s_i]
            t[f"kv.{src}"][idx[b_i], g] = adds[f"kv.{src}"][b_i, s_i].to(t[f"kv.{src}"].dtype)
            t[f"index_k.{src}"][idx[b_i], g] = adds[f"index_k.{src}"][b_i, s_i].to(
                t[f"index_k.{src}"].dtype)
            if f"comp_kv.{src}" in t:
                t[f"comp_kv.{src}"][idx] = adds[f"comp_kv.{src}"]
                t[f"comp_score.{src}"][idx] = adds[f"comp_score.{src}"]
        t["engram_hist"][idx] = adds["engram_hist"]
        t["seq_len"][idx] = adds["seq_len"]
        if "replay_start" in adds:
            t["replay_start"][idx] = adds["replay_start"]
