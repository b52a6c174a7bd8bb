"""CacheManager: the contract's pools for B slots x capacity C (PIPELINE.md §3, §5).

It hands slots to sequences and frees them, feeds engines the state of a set of slots, writes a
step's additions in place (ring slots, compressed entries where a group completed, compressor
state, lookback ids, seq_len, replay start) and reports bytes. The pools are allocated once;
nothing grows while serving.
"""

from __future__ import annotations

import torch

from dsflash.export.graphs import additions_for_cache
from dsflash.model.accounting import global_kv_bytes_per_token, max_sequences, per_sequence_bytes
from dsflash.model.cache import ModelCache
from dsflash.model.config import ModelConfig


class CacheManager:
    def __init__(self, cfg: ModelConfig, slots: int, capacity: int, device="cpu",
                 dtype: torch.dtype = torch.float32):
        self.cfg, self.capacity = cfg, capacity
        self.cache = ModelCache.allocate(cfg, slots, capacity, device, dtype)
        self._free = list(range(slots))[::-1]

    @property
    def slots(self) -> int:
        return self.cache.batch

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.slots} cache slots are in use")
        slot = self._free.pop()
        self.cache.reset([slot])
        return slot

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.slots or slot in self._free:
            raise ValueError(f"slot {slot} is not in use (slots: {self.slots})")
        self.cache.reset([slot])
        self._free.append(slot)

    def seq_len(self, slot: int) -> int:
        return int(self.cache.seq_len[slot])

    def feeds(self, slots: list[int], input_names: list[str], ids: torch.Tensor) -> dict:
        idx = self.cache.slot_index(slots)
        self.cache.check_room(idx, ids.shape[1])
        state = self.cache.gather(idx)
        ids = ids.to(state["seq_len"].device)  # the pools' device (the generator builds ids on the host)
        return {n: (ids if n == "ids" else state[n]) for n in input_names}

    def write(self, graph: str, slots: list[int], outputs: dict, seq_len_before: torch.Tensor) -> None:
        idx = self.cache.slot_index(slots)
        self.cache.write(additions_for_cache(self.cfg, graph, outputs, seq_len_before), idx)

    def bytes_report(self, fmt: str = "released") -> dict:
        """Global KV per token, per-sequence constants, and what this manager holds."""
        return {"global_kv_per_token": global_kv_bytes_per_token(self.cfg, fmt),
                "per_sequence": per_sequence_bytes(self.cfg, fmt),
                "allocated": self.cache.nbytes()}

    def max_sequences(self, budget_bytes: int, context_len: int, fmt: str = "released") -> int:
        return max_sequences(self.cfg, budget_bytes, context_len, fmt)
