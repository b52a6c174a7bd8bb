"""The reference model's cache: the state of PIPELINE.md §3 for `batch` slots and `capacity` tokens.

  swa_kv              [L, B, W, D]     window ring of every layer, slot = position mod W
  kv.<src>            [B, C/m, D]      compressed global KV of each KV source (ratio m); with kv_qat
                                       the release's FP4 form: e2m1 codes [B, C/m, D/2] uint8
  kv_scale.<src>      [B, C/m, D/16]   kv_qat only: each 16-channel block's e4m3 scale, its bits
                      uint8            (model/quant.py:fp4_e4m3scale_pack; 288 B per 512-dim entry)
  index_k.<src>       [B, C/m, J]      indexer keys of each KV source; with kv_qat the release's
                                       FP4 form: e2m1 codes [B, C/m, J/2] uint8 (two per byte)
  index_e.<src>       [B, C/m, J/32]   kv_qat only: each 32-channel block's power-of-two exponent
                      int8             (model/quant.py:fp4_pow2_pack; 68 B per 128-dim key, not 256)
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
from dsflash.model.config_checks import positive_int, whole_number


@dataclass(frozen=True)
class StateSpec:
    """One state tensor: shape as a formula over named dimensions (see `resolve_shape`)."""

    name: str
    dtype: str                  # "model" (the model's float dtype), "float32", "int64", "uint8", "int8"
    shape: tuple[str, ...]      # named dimensions or integer literals as text
    owners: tuple[int, ...]     # layers that own it (empty: per sequence)
    fill: float                 # value of an empty slot
    doc: str = ""


def state_layout(cfg: ModelConfig) -> list[StateSpec]:
    """Every state tensor of the model, in a fixed order. The single declaration the export
    contract, the runtime's cache manager and this cache are built from."""
    specs = [StateSpec("swa_kv", "model", ("L", "B", "W", "Dh"), tuple(range(cfg.num_hidden_layers)),
                       0.0, "window ring of every layer, slot = position mod W")]
    for src in cfg.kv_source_layer_ids:
        m = cfg.layer_ratio(src)
        specs += entry_specs(cfg, src, ("B", f"N{m}"))
        specs += index_key_specs(cfg, src, ("B", f"N{m}"))
        if m > 1:
            specs += [StateSpec(f"comp_kv.{src}", "float32", ("B", str(m - 1), "Dh"), (src,), 0.0,
                                "pending rows of the partial group, right-aligned"),
                      StateSpec(f"comp_score.{src}", "float32", ("B", str(m - 1), "Dh"), (src,), 0.0,
                                "gate scores of the pending rows")]
    specs += [StateSpec("engram_hist", "int64", ("B", "Hist"), (), -1,
                        "last max_ngram-1 token ids, -1 before the sequence start"),
              StateSpec("seq_len", "int64", ("B",), (), 0, "tokens already in the cache"),
              StateSpec("replay_start", "int64", ("B",), (), 0,
                        "first position whose decoder-layer window rows exist")]
    return specs


def entry_specs(cfg: ModelConfig, src: int, rows: tuple[str, ...]) -> list[StateSpec]:
    """Compressed entries of KV source src with leading dims `rows`: in the model dtype, or with
    kv_qat the FP4 codes and e4m3 scales they are exactly (CSA2Attention._publish)."""
    m = cfg.layer_ratio(src)
    if not cfg.kv_qat:
        return [StateSpec(f"kv.{src}", "model", (*rows, "Dh"), (src,), 0.0,
                          f"compressed global KV of source layer {src} (ratio {m})")]
    return [StateSpec(f"kv.{src}", "uint8", (*rows, "Dh_codes"), (src,), 0,
                      f"compressed global KV of source layer {src} (ratio {m}): FP4 e2m1 codes, "
                      "two per byte"),
            StateSpec(f"kv_scale.{src}", "uint8", (*rows, "Dh_blocks"), (src,), 0,
                      f"compressed global KV of source layer {src}: e4m3 scale bits per 16 channels")]


def index_key_specs(cfg: ModelConfig, src: int, rows: tuple[str, ...]) -> list[StateSpec]:
    """Index keys of KV source src with leading dims `rows`: bf16/fp32 keys, or with kv_qat the
    FP4 codes and exponents they are exactly (the keys are FP4 values already: Indexer.keys)."""
    if not cfg.kv_qat:
        return [StateSpec(f"index_k.{src}", "model", (*rows, "J"), (src,), 0.0,
                          f"indexer keys of source layer {src}")]
    return [StateSpec(f"index_k.{src}", "uint8", (*rows, "J_codes"), (src,), 0,
                      f"indexer keys of source layer {src}: FP4 e2m1 codes, two per byte"),
            StateSpec(f"index_e.{src}", "int8", (*rows, "J_blocks"), (src,), 0,
                      f"indexer keys of source layer {src}: power-of-two exponent per 32 channels")]


def static_dims(cfg: ModelConfig) -> dict[str, int]:
    return {"L": cfg.num_hidden_layers, "D_enc": cfg.first_decoder_layer, "W": cfg.sliding_window,
            "Dh": cfg.head_dim, "Dh_codes": cfg.head_dim // 2, "Dh_blocks": cfg.head_dim // 16,
            "J": cfg.index_head_dim, "J_codes": cfg.index_head_dim // 2,
            "J_blocks": cfg.index_head_dim // 32, "V": cfg.vocab_size, "Hist": cfg.engram_max_ngram_size - 1}


def resolve_shape(shape: tuple[str, ...], cfg: ModelConfig, batch: int, capacity: int,
                  rows: int = 1) -> tuple[int, ...]:
    """Numbers for a shape formula: B batch, S rows, N<m> = capacity // m, the rest static."""
    dims = static_dims(cfg) | {"B": batch, "S": rows}
    out = []
    for name in shape:
        if name.isdigit():
            out.append(int(name))
        elif name.startswith("N") and name[1:].isdigit():
            out.append(capacity // int(name[1:]))
        else:
            out.append(dims[name])
    return tuple(out)


def spec_dtype(spec_dtype_name: str, model_dtype: torch.dtype) -> torch.dtype:
    if spec_dtype_name == "model":
        return model_dtype
    return {"float32": torch.float32, "int64": torch.int64, "bool": torch.bool, "uint8": torch.uint8,
            "int8": torch.int8}[spec_dtype_name]


class ModelCache:
    """Preallocated state for `batch` slots; each slot holds one sequence of <= capacity tokens."""

    def __init__(self, cfg: ModelConfig, capacity: int, tensors: dict[str, torch.Tensor]):
        self.cfg, self.capacity, self.tensors = cfg, capacity, tensors

    @classmethod
    def allocate(cls, cfg: ModelConfig, batch: int, capacity: int, device="cpu",
                 dtype: torch.dtype = torch.float32) -> ModelCache:
        batch = positive_int("batch", batch)
        if not 0 < whole_number("capacity", capacity) <= cfg.max_position_embeddings:
            raise ValueError(f"capacity={capacity} must be in [1, max_position_embeddings="
                             f"{cfg.max_position_embeddings}]")
        tensors = {s.name: torch.full(resolve_shape(s.shape, cfg, batch, capacity), s.fill,
                                      dtype=spec_dtype(s.dtype, dtype), device=device)
                   for s in state_layout(cfg)}
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
        if isinstance(slots, torch.Tensor):
            slots = slots.reshape(-1).tolist()
        ids = check_slot_ids(slots, self.batch)  # on the host: no device round trip per step
        return torch.tensor(ids, dtype=torch.int64, device=device)

    def slot_run(self, slots) -> slice | None:
        """slots as a slice when they are one ascending run (e.g. [2, 3, 4]), else None."""
        ids = check_slot_ids(slots, self.batch)
        if ids and ids == list(range(ids[0], ids[0] + len(ids))):
            return slice(ids[0], ids[0] + len(ids))
        return None

    def views(self, run: slice) -> dict[str, torch.Tensor]:
        """The state of a run of slots without a copy: views into the pools, which `write`
        later updates in place (a caller that keeps them sees the new state)."""
        return {k: _slots_of(k, v, run) for k, v in self.tensors.items()}

    def move_slot(self, src: int, dst: int) -> None:
        """Copy slot src's whole state into slot dst (one slot's bytes; the runtime compacts its
        running sequences into the lowest slots with it)."""
        check_slot_ids([src, dst], self.batch)
        for k, v in self.tensors.items():
            _slots_of(k, v, dst).copy_(_slots_of(k, v, src))

    def reset(self, slots=None) -> None:
        """Empty the given slots (stale values in rings and entries are masked by seq_len)."""
        idx = self.slot_index(slots)
        self.tensors["seq_len"][idx] = 0
        self.tensors["replay_start"][idx] = 0
        self.tensors["engram_hist"][idx] = -1

    def check_room(self, idx: torch.Tensor, new_rows: int) -> None:
        lens = self.seq_len[idx]
        check_capacity(int(lens.max()) + new_rows if lens.numel() else new_rows, self.capacity)

    def gather(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state of the selected slots (batch axis first except the per-layer ring)."""
        out = {k: _slots_of(k, v, idx) for k, v in self.tensors.items()}
        return out

    def write(self, adds: dict, idx: torch.Tensor) -> None:
        """Put a step's additions in place for slots idx (rows of `adds` follow idx's order)."""
        t, w = self.tensors, self.cfg.sliding_window
        rows = adds["swa_rows"]  # [Lr, b, S, D] for layers first_layer .. first_layer+Lr-1
        first = adds["swa_first_layer"]
        pos = adds["pos"]  # [b, S]
        keep = min(rows.shape[2], w)  # only the last W rows can survive in the ring
        ring_slot = (pos[:, -keep:] % w)
        # every decoder-side layer's ring at once: one indexed write of [Lr, b, keep, D] rows
        # (ring slots of the last keep <= W positions are distinct, so no two writes collide)
        swa = t["swa_kv"]
        layer = torch.arange(first, first + rows.shape[0], device=swa.device).view(-1, 1, 1)
        swa[layer, idx.view(1, -1, 1), ring_slot.unsqueeze(0)] = rows[:, :, -keep:].to(swa.dtype)
        for src in self.cfg.kv_source_layer_ids:
            if f"group.{src}" not in adds:
                continue
            self._write_entries(src, adds, idx)
            if f"comp_kv.{src}" in t:
                t[f"comp_kv.{src}"][idx] = adds[f"comp_kv.{src}"]
                t[f"comp_score.{src}"][idx] = adds[f"comp_score.{src}"]
        t["engram_hist"][idx] = adds["engram_hist"]
        t["seq_len"][idx] = adds["seq_len"]
        if "replay_start" in adds:
            t["replay_start"][idx] = adds["replay_start"]

    def _write_entries(self, src: int, adds: dict, idx: torch.Tensor) -> None:
        """Compressed entries of KV source src at the groups the step completed (group >= 0)."""
        group = adds[f"group.{src}"]  # [b, S]
        pools = [(self.tensors[f"{kind}.{src}"], adds[f"{kind}.{src}"])
                 for kind in ("kv", "kv_scale", "index_k", "index_e") if f"{kind}.{src}" in self.tensors]
        if group.shape[1] == 1 and pools[0][0].shape[1] > 0:
            # a decode step: one row per slot, so no two writes collide; a row that completes no
            # group writes back what its slot holds at entry 0 (no host round trip to find rows)
            done, g = group >= 0, group[:, 0].clamp_min(0)
            for pool, new in pools:
                pool[idx, g] = torch.where(done, new[:, 0].to(pool.dtype), pool[idx, g])
            return
        b_i, s_i = torch.nonzero(group >= 0, as_tuple=True)
        for pool, new in pools:
            pool[idx[b_i], group[b_i, s_i]] = new[b_i, s_i].to(pool.dtype)


def _slots_of(name: str, pool: torch.Tensor, index) -> torch.Tensor:
    """Slots `index` of a state tensor: the slot axis is the second for the per-layer ring
    (swa_kv [L, B, W, D]) and the first for every other state tensor (state_layout)."""
    return pool[:, index] if name == "swa_kv" else pool[index]


def check_capacity(need: int, capacity: int) -> None:
    """A step that would take a sequence to `need` tokens must fit the cache's capacity."""
    if need > capacity:
        raise ValueError(f"sequence would reach {need} tokens, over the cache capacity {capacity}")


def check_slot_ids(slots, batch: int) -> list[int]:
    """Slot ids as a list of ints, each in [0, batch) and none twice; a clear error otherwise."""
    ids = [int(s) for s in (slots if isinstance(slots, (list, tuple, range)) else [slots])]
    bad = [s for s in ids if not 0 <= s < batch]
    if bad:
        raise ValueError(f"slot ids {ids} outside [0, {batch})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"slot ids {ids} contain duplicates")
    return ids
