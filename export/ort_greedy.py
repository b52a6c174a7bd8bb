"""Drive a bundle's graphs on ONNX Runtime over the reference cache: prefill (replay or exact)
and greedy decoding. The oracle loop for graph-level checks and the CPU demo; the serving loop
with batching and streaming is dsflash.runtime's."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from dsflash.export.bundle import Bundle
from dsflash.export.contract import GRAPHS, graph_inputs, graph_outputs
from dsflash.export.graphs import additions_for_cache
from dsflash.export.ort_session import ort_session
from dsflash.model.cache import ModelCache
from dsflash.model.model import encoder_rows


class OrtGraphs:
    def __init__(self, bundle: Bundle, flavor: str = "portable", providers: list[str] | None = None):
        self.bundle, self.cfg = bundle, bundle.config
        self.sessions = {g: ort_session(bundle, g, flavor, providers) for g in GRAPHS}
        self.inputs = {g: [t.name for t in graph_inputs(self.cfg, g)] for g in GRAPHS}
        self.outputs = {g: [t.name for t in graph_outputs(self.cfg, g)] for g in GRAPHS}

    def run(self, graph: str, ids: torch.Tensor, cache: ModelCache, slots) -> dict[str, torch.Tensor]:
        """One graph call for `slots`; writes the additions into `cache`, returns the outputs."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"token ids span [{int(ids.min())}, {int(ids.max())}], outside the "
                             f"vocabulary [0, {self.cfg.vocab_size})")
        idx = cache.slot_index(slots)
        cache.check_room(idx, ids.shape[1])
        state = cache.gather(idx)
        feeds = OrderedDict((n, (ids if n == "ids" else state[n]).numpy()) for n in self.inputs[graph])
        outs = self.sessions[graph].run(self.outputs[graph], dict(feeds))
        named = {n: torch.from_numpy(np.asarray(v)) for n, v in zip(self.outputs[graph], outs)}
        cache.write(additions_for_cache(self.cfg, graph, named, state["seq_len"]), idx)
        return named

    def prefill(self, prompt: list[int], cache: ModelCache, slot: int, mode: str = "replay") -> torch.Tensor:
        ids = torch.tensor([prompt], dtype=torch.int64)
        split = encoder_rows(self.cfg, len(prompt), mode)
        if split:
            self.run("encoder_prefill", ids[:, :split], cache, [slot])
        return self.run("decoder_step", ids[:, split:], cache, [slot])["logits"]

    def greedy(self, prompt: list[int], max_new_tokens: int, mode: str = "replay") -> list[int]:
        cache = ModelCache.allocate(self.cfg, 1, len(prompt) + max_new_tokens)
        logits, out = self.prefill(prompt, cache, 0, mode), []
        for i in range(max_new_tokens):
            tok = int(logits.argmax(-1))
            out.append(tok)
            if i + 1 < max_new_tokens:
                logits = self.run("decoder_step", torch.tensor([[tok]]), cache, [0])["logits"]
        return out
