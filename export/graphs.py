"""Stateless wrappers of the reference model's two graph functions (state in, additions out).

`GraphModule(model, graph)` takes its inputs positionally in the contract's order and returns
its outputs in the contract's order, so the same module is exported to ONNX and run eagerly as
the oracle. `additions_for_cache` turns a graph's outputs back into what `ModelCache.write`
(and the runtime's cache manager) expects.
"""

from __future__ import annotations

import torch
from torch import nn

from dsflash.export.contract import graph_inputs, graph_outputs
from dsflash.model.cache import entry_specs, index_key_specs, resolve_shape, spec_dtype
from dsflash.model.model import DSFlashModel


class GraphModule(nn.Module):
    def __init__(self, model: DSFlashModel, graph: str):
        super().__init__()
        self.model, self.graph = model, graph
        self.input_names = [t.name for t in graph_inputs(model.cfg, graph)]
        self.output_names = [t.name for t in graph_outputs(model.cfg, graph)]

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.model.cfg
        if len(tensors) != len(self.input_names):
            raise ValueError(f"{self.graph} takes {len(self.input_names)} inputs "
                             f"({self.input_names}), got {len(tensors)}")
        state = dict(zip(self.input_names, tensors))
        ids = state.pop("ids")
        if self.graph == "encoder_prefill":
            d = cfg.first_decoder_layer
            state["replay_start"] = torch.zeros_like(state["seq_len"])
            if cfg.layer_role(d) == "full":  # layer D only publishes: its cached entries are unused
                b = ids.shape[0]
                for spec in entry_specs(cfg, d, ("B", "N1")) + index_key_specs(cfg, d, ("B", "N1")):
                    shape = resolve_shape(spec.shape, cfg, b, 0)
                    dtype = spec_dtype(spec.dtype, state["swa_kv"].dtype)
                    state[spec.name] = state["swa_kv"].new_zeros(shape, dtype=dtype)
            logits, adds = self.model.step_additions(ids, state, 0, d, publish_layer=d,
                                                     all_logits=False)
        else:
            logits, adds = self.model.step_additions(ids, state, 0, cfg.num_hidden_layers,
                                                     publish_layer=None, all_logits=False)
        outputs = {"new_swa_rows": adds["swa_rows"], "new_engram_hist": adds["engram_hist"],
                   "new_seq_len": adds["seq_len"], "logits": logits}
        for src in cfg.kv_source_layer_ids:
            for key in ("kv", "kv_scale", "index_k", "index_e", "group", "comp_kv", "comp_score"):
                if f"{key}.{src}" in adds:
                    outputs[f"new_{key}.{src}"] = adds[f"{key}.{src}"]
        return tuple(outputs[name] for name in self.output_names)

    def example_inputs(self, batch: int, capacity: int, rows: int, dtype=torch.float32,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
        """Inputs of the right shapes: random ids, an empty cache (for export and smoke runs)."""
        from dsflash.model.cache import ModelCache

        cfg = self.model.cfg
        cache = ModelCache.allocate(cfg, batch, capacity, dtype=dtype)
        ids = torch.randint(0, cfg.vocab_size, (batch, rows), generator=generator)
        feeds = {"ids": ids, **cache.tensors}
        return tuple(feeds[n] for n in self.input_names)


def additions_for_cache(cfg, graph: str, outputs: dict[str, torch.Tensor],
                        seq_len_before: torch.Tensor) -> dict:
    """Graph outputs -> the additions dict of `ModelCache.write` (the runtime writes the same)."""
    rows = outputs["new_swa_rows"]
    s = rows.shape[2]
    adds = {"swa_rows": rows, "swa_first_layer": 0,
            "pos": seq_len_before.unsqueeze(1) + torch.arange(s, device=rows.device),
            "engram_hist": outputs["new_engram_hist"], "seq_len": outputs["new_seq_len"]}
    for name, value in outputs.items():
        if name.startswith("new_") and "." in name:
            adds[name[len("new_"):]] = value
    if graph == "encoder_prefill":
        adds["replay_start"] = outputs["new_seq_len"]
    return adds
