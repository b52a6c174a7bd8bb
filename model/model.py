"""DSFlashModel: the reference model and its two graph functions (PIPELINE.md §2).

  forward(ids)                 every layer on every row (training form, the oracle)
  encoder_prefill(ids, cache)  layers 0 .. D-1 on the rows, then only layer D's compressor
                               publication; no logits. Decoder windows will start after these rows.
  decoder_step(ids, cache)     all layers on S new rows, logits of the last row (or all rows)
  prefill(ids, cache, mode)    replay: encoder_prefill(ids[:-W]) + decoder_step(ids[-W:]);
                               exact: decoder_step over all rows (optionally in chunks)
Steps are functional inside (`step_additions`: state in, additions out) so export can wrap them;
the public methods gather a cache's slots, run, and write the additions back.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dsflash.model.attention import SourceState, StepShared
from dsflash.model.block import Block
from dsflash.model.cache import ModelCache
from dsflash.model.config import ModelConfig
from dsflash.model.dtypes import f32
from dsflash.model.engram_hash import (
    layer_addressing,
    synthetic_compression_map,
)
from dsflash.model.mhc import hc_collapse, hc_post
from dsflash.model.norm_rope import RMSNorm
from dsflash.model.weights import init_weights
from dsflash.plugins.registry import OpSet

PREFILL_MODES = ("replay", "exact")


def check_prefill_mode(mode: str) -> str:
    """The prefill mode, or a ValueError naming it and the modes there are."""
    if mode not in PREFILL_MODES:
        raise ValueError(f"prefill mode {mode!r} is not 'replay' or 'exact'")
    return mode


def encoder_rows(cfg: ModelConfig, n_prompt: int, mode: str) -> int:
    """Prompt rows the encoder half takes in a prefill of `n_prompt` tokens: in replay mode all
    but the last `sliding_window` (the decoder replays those), in exact mode none (the whole
    model runs every row). The runtimes split a prompt the same way."""
    return max(n_prompt - cfg.sliding_window, 0) if check_prefill_mode(mode) == "replay" else 0


class DSFlashModel(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_map: np.ndarray | None = None):
        """vocab_map: the Engram tokenizer-compression map [vocab_size] (see
        `engram_hash.build_compression_map`); the test presets use the synthetic floor map."""
        super().__init__()
        self.cfg = cfg
        if vocab_map is None:
            vocab_map = synthetic_compression_map(cfg.vocab_size, cfg.engram_compressed_vocab_size)
        vocab_map = np.asarray(vocab_map, dtype=np.int64)
        if vocab_map.shape != (cfg.vocab_size,):
            raise ValueError(f"vocab_map has shape {vocab_map.shape}, expected ({cfg.vocab_size},)")
        if vocab_map.min() < 0 or vocab_map.max() >= cfg.engram_compressed_vocab_size:
            raise ValueError(f"vocab_map values span [{vocab_map.min()}, {vocab_map.max()}], outside "
                             f"[0, engram_compressed_vocab_size={cfg.engram_compressed_vocab_size})")
        self.addressing = layer_addressing(cfg, vocab_map) if cfg.engram_layer_ids else {}
        self.register_buffer("engram_vocab_map", torch.from_numpy(vocab_map), persistent=False)
        # The custom ops' implementation (reference maths, or torch.library ops for export).
        self.ops = OpSet("reference")
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i, self.ops, self.addressing.get(i))
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def init_weights(self, seed: int = 0) -> DSFlashModel:
        init_weights(self, seed)
        return self

    # ------------------------------------------------------------------ public API
    def forward(self, ids_BS: torch.Tensor, trace: StepShared | None = None) -> torch.Tensor:
        """Logits [B, S, V] (fp32) of every row, no cache. `trace` receives what layers publish."""
        ids_BS = self._check_ids(ids_BS)
        state = self._empty_state(ids_BS.shape[0])
        logits, _ = self.step_additions(ids_BS, state, 0, self.cfg.num_hidden_layers,
                                        publish_layer=None, all_logits=True, shared=trace)
        return logits

    @torch.no_grad()
    def decoder_step(self, ids_BS: torch.Tensor, cache: ModelCache, slots=None,
                     all_logits: bool = False) -> torch.Tensor:
        ids_BS, idx = self._prepare(ids_BS, cache, slots)
        logits, adds = self.step_additions(ids_BS, cache.gather(idx), 0, self.cfg.num_hidden_layers,
                                           publish_layer=None, all_logits=all_logits)
        cache.write(adds, idx)
        return logits

    @torch.no_grad()
    def encoder_prefill(self, ids_BS: torch.Tensor, cache: ModelCache, slots=None) -> None:
        ids_BS, idx = self._prepare(ids_BS, cache, slots)
        if ids_BS.shape[1] == 0:
            return
        d = self.cfg.first_decoder_layer
        _, adds = self.step_additions(ids_BS, cache.gather(idx), 0, d, publish_layer=d,
                                      all_logits=False)
        adds["replay_start"] = adds["seq_len"]
        cache.write(adds, idx)

    @torch.no_grad()
    def prefill(self, ids_BS: torch.Tensor, cache: ModelCache, slots=None, mode: str = "replay",
                chunk: int | None = None) -> torch.Tensor:
        """Prompt rows into empty slots; returns the last row's logits [B, V]."""
        ids_BS = self._check_ids(ids_BS)
        idx = cache.slot_index(slots)
        if bool((cache.seq_len[idx] != 0).any()):
            raise ValueError(f"prefill needs empty slots; seq_len of slots {idx.tolist()} is "
                             f"{cache.seq_len[idx].tolist()}")
        n = ids_BS.shape[1]
        if n == 0:
            raise ValueError("prefill needs at least one prompt token")
        cache.check_room(idx, n)
        if check_prefill_mode(mode) == "replay":
            split = encoder_rows(self.cfg, n, mode)
            self.encoder_prefill(ids_BS[:, :split], cache, idx)
            return self.decoder_step(ids_BS[:, split:], cache, idx)
        chunk = chunk or n
        if chunk <= 0:
            raise ValueError(f"chunk={chunk} must be > 0")
        for start in range(0, n, chunk):
            logits = self.decoder_step(ids_BS[:, start: start + chunk], cache, idx)
        return logits

    # ------------------------------------------------------------------ the functional step
    def step_additions(self, ids_BS: torch.Tensor, state: dict, first: int, stop: int,
                       publish_layer: int | None, all_logits: bool,
                       shared: StepShared | None = None):
        """Run layers [first, stop) on the S new rows of every slot in `state`.

        With publish_layer, also run that layer's compressor publication (encoder_prefill).
        Returns (logits or None, additions for `ModelCache.write`).
        """
        cfg = self.cfg
        b, s = ids_BS.shape
        seq_len = state["seq_len"]
        pos = seq_len.unsqueeze(1) + torch.arange(s, device=ids_BS.device)
        hist = state["engram_hist"]
        cids = self._compressed_ids(torch.cat((hist, ids_BS), dim=1))
        streams = self.embed(ids_BS).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1).contiguous()
        pi = torch.zeros(b, s, cfg.hc_mult, device=ids_BS.device)
        pi[..., 0] = 1.0  # layer 0's attention collapses stream 0 only
        shared = StepShared() if shared is None else shared
        adds, swa_rows, pending = {}, [], None  # pending: the last FFN's (y, post, comb)
        for i in range(first, stop):
            blk = self.layers[i]
            if pending is None or blk.engram is not None:
                if pending is not None:
                    streams = hc_post(streams, *pending)
                streams, x, coeffs = blk.enter(streams, pi, cids)
            else:
                streams, x, coeffs = blk.attn_boundary(streams, *pending, pi)
            args = dict(pos_BS=pos, shared=shared, source=self._source_state(state, i),
                        **self._window(state, i, pos))
            streams, y, (pi, f_post, f_comb), kv_rows, src_adds = blk(streams, x, coeffs, args)
            pending = (y, f_post, f_comb)
            swa_rows.append(kv_rows)
            self._collect(adds, i, src_adds)
        if pending is not None:
            streams = hc_post(streams, *pending)
        if publish_layer is not None:
            blk = self.layers[publish_layer]
            if blk.engram is not None:
                streams = blk.engram(streams, cids)
            x = blk.attn_norm(hc_collapse(streams, pi))
            src_adds = blk.attn._publish(x, pos, self._source_state(state, publish_layer), shared)
            self._collect(adds, publish_layer, src_adds)
        adds.update(swa_rows=torch.stack(swa_rows), swa_first_layer=first, pos=pos,
                    engram_hist=torch.cat((hist, ids_BS), 1)[:, -hist.shape[1]:],
                    seq_len=seq_len + s)
        if publish_layer is not None or stop < cfg.num_hidden_layers:
            return None, adds
        x = self.norm(hc_collapse(streams, pi))
        if not all_logits:
            x = x[:, -1]
        return f32(self.head(x)), adds

    # ------------------------------------------------------------------ helpers
    def _check_ids(self, ids_BS) -> torch.Tensor:
        ids_BS = torch.as_tensor(ids_BS, dtype=torch.int64, device=self.embed.weight.device)
        if ids_BS.dim() != 2:
            raise ValueError(f"ids must be [batch, rows], got shape {tuple(ids_BS.shape)}")
        if ids_BS.numel() and (int(ids_BS.min()) < 0 or int(ids_BS.max()) >= self.cfg.vocab_size):
            bad = int(ids_BS.min()) if int(ids_BS.min()) < 0 else int(ids_BS.max())
            raise ValueError(f"token id {bad} outside the vocabulary [0, {self.cfg.vocab_size})")
        return ids_BS

    def _prepare(self, ids_BS, cache: ModelCache, slots):
        ids_BS = self._check_ids(ids_BS)
        idx = cache.slot_index(slots)
        if ids_BS.shape[0] != idx.numel():
            raise ValueError(f"ids have batch {ids_BS.shape[0]} but {idx.numel()} slots are addressed")
        cache.check_room(idx, ids_BS.shape[1])
        return ids_BS, idx

    def _empty_state(self, batch: int) -> dict:
        """A cache of capacity 0: forward() sees only its own rows."""
        cache = ModelCache.allocate(self.cfg, batch, 1, self.embed.weight.device,
                                    self.embed.weight.dtype)
        state = cache.gather(cache.slot_index(None))
        state["swa_kv"] = state["swa_kv"][:, :, :0]
        for src in self.cfg.kv_source_layer_ids:
            for key in (f"kv.{src}", f"kv_scale.{src}", f"index_k.{src}", f"index_e.{src}"):
                if key in state:
                    state[key] = state[key][:, :0]
        return state

    def _compressed_ids(self, ids_hist_BT: torch.Tensor) -> torch.Tensor:
        """Token ids -> Engram compressed ids; -1 (before the sequence start) stays -1."""
        return torch.where(ids_hist_BT >= 0, self.engram_vocab_map[ids_hist_BT.clamp_min(0)],
                           torch.full_like(ids_hist_BT, -1))

    def _window(self, state: dict, layer: int, pos_BS: torch.Tensor) -> dict:
        """Ring rows of this layer with their positions (the ring holds seq_len-W .. seq_len-1)."""
        ring = state["swa_kv"][layer]
        w = ring.shape[1]
        seq_len = state["seq_len"].unsqueeze(1)
        r = torch.arange(w, device=ring.device).unsqueeze(0)
        ring_pos = seq_len - w + torch.remainder(r - seq_len, w) if w else r.expand(len(seq_len), 0)
        start = (state["replay_start"] if self.cfg.is_decoder_layer(layer)
                 else torch.zeros_like(state["replay_start"]))
        return dict(win_kv_BTD=ring, win_pos_BT=ring_pos, win_start_B=start)

    def _source_state(self, state: dict, layer: int) -> SourceState | None:
        if self.cfg.layer_role(layer) != "full":
            return None
        m, kv = self.cfg.layer_ratio(layer), state[f"kv.{layer}"]
        n_done = (state["seq_len"] // m).unsqueeze(1)
        g = torch.arange(kv.shape[1], device=kv.device).unsqueeze(0)
        b = kv.shape[0]
        empty = kv.new_zeros(b, 0, self.cfg.head_dim, dtype=torch.float32)
        return SourceState(kv_BND=kv, kv_scale_BNG=state.get(f"kv_scale.{layer}"),
                           index_k_BNJ=state[f"index_k.{layer}"],
                           index_e_BNG=state.get(f"index_e.{layer}"),
                           group_BN=torch.where(g < n_done, g, torch.full_like(g, -1)).expand(b, -1),
                           comp_kv=state.get(f"comp_kv.{layer}", empty),
                           comp_score=state.get(f"comp_score.{layer}", empty))

    @staticmethod
    def _collect(adds: dict, layer: int, src_adds: dict | None) -> None:
        if src_adds is None:
            return
        for key, value in src_adds.items():
            adds[f"{key}.{layer}"] = value
