"""CacheManager: the contract's pools for B slots x capacity C (PIPELINE.md §3, §5).

It hands slots to sequences (the lowest free one first), frees and moves them, feeds engines the
state of a set of slots (views of the pools when the slots are one run, so a decode step copies no
state), writes a step's additions in place (ring slots, compressed entries where a group
completed, compressor state, lookback ids, seq_len, replay start) and reports bytes. The pools are
allocated once; nothing grows while serving.
"""

from __future__ import annotations

import heapq

import torch

from dsflash.export.graphs import additions_for_cache
from dsflash.model.accounting import global_kv_bytes_per_token, max_sequences, per_sequence_bytes
from dsflash.model.cache import ModelCache, check_capacity, check_slot_ids
from dsflash.model.config import ModelConfig
from dsflash.model.config_checks import positive_int


class CacheManager:
    def __init__(self, cfg: ModelConfig, slots: int, capacity: int, device="cpu",
                 dtype: torch.dtype = torch.float32):
        slots = positive_int("slots", slots)  # named as the caller knows it (the cache says batch)
        self.cfg, self.capacity = cfg, capacity
        self.cache = ModelCache.allocate(cfg, slots, capacity, device, dtype)
        self._free = list(range(slots))  # a heap: acquire hands out the lowest free slot
        # tokens per slot, mirrored on the host so the room check needs no device round trip
        self._lens = [0] * slots
        self._index: dict[tuple, torch.Tensor] = {}

    @property
    def slots(self) -> int:
        return self.cache.batch

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.slots} cache slots are in use")
        slot = heapq.heappop(self._free)
        self.cache.reset([slot])
        self._lens[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.slots or slot in self._free:
            raise ValueError(f"slot {slot} is not in use (slots: {self.slots})")
        self.cache.reset([slot])
        self._lens[slot] = 0
        heapq.heappush(self._free, slot)

    def lowest_free(self) -> int | None:
        return self._free[0] if self._free else None

    def move(self, src: int, dst: int) -> None:
        """Move the sequence in slot src to the free slot dst (one slot's state copied once);
        src is free afterwards."""
        if src in self._free or not 0 <= src < self.slots:
            raise ValueError(f"slot {src} is not in use (slots: {self.slots})")
        if dst not in self._free:
            raise ValueError(f"slot {dst} is not free")
        self._free.remove(dst)
        heapq.heapify(self._free)
        self.cache.move_slot(src, dst)
        self._lens[dst] = self._lens[src]
        self.release(src)

    def sync_lengths(self) -> None:
        """Reload the host's copy of every slot's length from the pools (one device round trip),
        after state was put into the pools directly (a restored or synthetic cache)."""
        self._lens = [int(n) for n in self.cache.seq_len.tolist()]

    def seq_len(self, slot: int) -> int:
        return int(self.cache.seq_len[slot])

    def in_place(self, slots: list[int]) -> bool:
        """Whether `feeds` hands out views of the pools for these slots (one ascending run)
        rather than a gathered copy; an engine may then read them in place across calls."""
        return self.cache.slot_run(slots) is not None

    def feeds(self, slots: list[int], input_names: list[str], ids: torch.Tensor) -> dict:
        """The graph inputs of a step for `slots`: views of the pools when the slots are one
        ascending run (the generator keeps its running sequences in the lowest slots, so a
        decode step copies no state), else the gathered state of the slots."""
        slots = check_slot_ids(slots, self.slots)
        check_capacity(max((self._lens[s] for s in slots), default=0) + ids.shape[1], self.capacity)
        run = self.cache.slot_run(slots)
        state = self.cache.views(run) if run is not None else self.cache.gather(self._slot_index(slots))
        ids = ids.to(state["seq_len"].device)  # the pools' device (the generator builds ids on the host)
        return {n: (ids if n == "ids" else state[n]) for n in input_names}

    def write(self, graph: str, slots: list[int], outputs: dict, seq_len_before: torch.Tensor) -> None:
        adds = additions_for_cache(self.cfg, graph, outputs, seq_len_before)
        self.cache.write(adds, self._slot_index(slots))
        rows = outputs["new_swa_rows"].shape[2]
        for s in slots:
            self._lens[s] += rows

    def _slot_index(self, slots: list[int]) -> torch.Tensor:
        key = tuple(slots)
        if key not in self._index:  # a few batch compositions recur: no host-to-device copy each step
            if len(self._index) >= 64:
                self._index.clear()
            self._index[key] = self.cache.slot_index(slots)
        return self._index[key]

    def bytes_report(self, fmt: str = "released") -> dict:
        """Global KV per token, per-sequence constants, and what this manager holds."""
        return {"global_kv_per_token": global_kv_bytes_per_token(self.cfg, fmt),
                "per_sequence": per_sequence_bytes(self.cfg, fmt),
                "allocated": self.cache.nbytes()}

    def max_sequences(self, budget_bytes: int, context_len: int, fmt: str = "released") -> int:
        return max_sequences(self.cfg, budget_bytes, context_len, fmt)


def synthetic_cache(cfg: ModelConfig, batch: int, context: int, steps: int, device: str,
                    dtype: torch.dtype, seed: int) -> CacheManager:
    """`batch` sequences of `context` tokens with random state (rings, entries, index keys,
    compressor state, lookback ids), room for `steps` more tokens each: decode steps at a given
    context without a prefill (benchmarks, tests)."""
    cm = CacheManager(cfg, batch, context + steps, device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    for _ in range(batch):
        cm.acquire()
    for name, t in cm.cache.tensors.items():
        if t.is_floating_point():
            t.normal_(generator=gen)
        elif name.startswith("kv_scale."):  # kv_qat's entry scales: e4m3 bits of 0.25 .. 0.9375,
            t.random_(40, 55, generator=gen)  # as the QAT gives unit-normal entries (amax / 6)
        elif t.dtype == torch.uint8:  # kv_qat's FP4 codes: any byte is two valid e2m1 codes
            t.random_(0, 256, generator=gen)
        elif t.dtype == torch.int8:  # and their exponents: scales 2^-4 .. 2^0, as unit-normal keys'
            t.random_(-4, 1, generator=gen)
    cm.cache.tensors["engram_hist"].random_(0, cfg.vocab_size, generator=gen)
    cm.cache.tensors["seq_len"].fill_(context)
    cm.cache.tensors["replay_start"].zero_()
    cm.sync_lengths()
    return cm
