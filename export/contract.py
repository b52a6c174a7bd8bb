"""The state contract (PIPELINE.md §3): which state each graph reads, what it returns, and the
dynamic dimensions. The state tensors themselves are declared once, in
`dsflash.model.cache.state_layout`; this module adds the graphs' view of them. Export, the bundle
manifest, engine loaders, the runtime and the tests read it from here.

Graphs take the cache as inputs and return only the step's additions; the runtime writes them in
place. Dynamic dimensions: B (batch slots), S (new rows), N<m> (entries of ratio-m sources).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dsflash.model.cache import (
    entry_specs,
    index_key_specs,
    resolve_shape,
    spec_dtype,
    state_layout,
    static_dims,
)
from dsflash.model.config import ModelConfig

GRAPHS = ("encoder_prefill", "decoder_step")


@dataclass(frozen=True)
class GraphTensor:
    name: str
    dtype: str
    shape: tuple[str, ...]
    doc: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    def dynamic_axes(self) -> dict[int, str]:
        return {i: n for i, n in enumerate(self.shape)
                if n in ("B", "S") or (n.startswith("N") and n[1:].isdigit())}

    def resolve(self, cfg: ModelConfig, batch: int, capacity: int, rows: int) -> tuple[int, ...]:
        return resolve_shape(self.shape, cfg, batch, capacity, rows)

    def torch_dtype(self, model_dtype):
        return spec_dtype(self.dtype, model_dtype)


def _check_graph(graph: str) -> None:
    if graph not in GRAPHS:
        raise ValueError(f"unknown graph {graph!r}; graphs: {GRAPHS}")


def reads(cfg: ModelConfig, graph: str, state_name: str) -> bool:
    """encoder_prefill never reads replay_start, nor the caches of layer D (it only publishes)."""
    if graph == "decoder_step":
        return True
    if state_name == "replay_start":
        return False
    d = cfg.first_decoder_layer
    return state_name not in (f"kv.{d}", f"kv_scale.{d}", f"index_k.{d}", f"index_e.{d}")


def graph_inputs(cfg: ModelConfig, graph: str) -> list[GraphTensor]:
    _check_graph(graph)
    ids = GraphTensor("ids", "int64", ("B", "S"), "new token ids")
    return [ids] + [GraphTensor(s.name, s.dtype, s.shape, s.doc) for s in state_layout(cfg)
                    if reads(cfg, graph, s.name)]


def graph_outputs(cfg: ModelConfig, graph: str) -> list[GraphTensor]:
    """The additions (window rows, one candidate entry per row per source, compressor state,
    lookback, seq_len), then the last row's logits for decoder_step."""
    _check_graph(graph)
    layers = "D_enc" if graph == "encoder_prefill" else "L"
    out = [GraphTensor("new_swa_rows", "model", (layers, "B", "S", "Dh"),
                       "window rows of every layer the graph ran, for positions seq_len ..")]
    for src in cfg.kv_source_layer_ids:
        m = cfg.layer_ratio(src)
        out += [GraphTensor(f"new_{s.name}", s.dtype, s.shape, "entry per row")
                for s in entry_specs(cfg, src, ("B", "S")) + index_key_specs(cfg, src, ("B", "S"))]
        out.append(GraphTensor(f"new_group.{src}", "int64", ("B", "S"),
                               "entry index each row completes, -1 where none"))
        if m > 1:
            out += [GraphTensor(f"new_comp_kv.{src}", "float32", ("B", str(m - 1), "Dh")),
                    GraphTensor(f"new_comp_score.{src}", "float32", ("B", str(m - 1), "Dh"))]
    out += [GraphTensor("new_engram_hist", "int64", ("B", "Hist")),
            GraphTensor("new_seq_len", "int64", ("B",))]
    if graph == "decoder_step":
        out.append(GraphTensor("logits", "float32", ("B", "V"), "last row's logits"))
    return out


def contract_dict(cfg: ModelConfig) -> dict:
    state = []
    for s in state_layout(cfg):
        d = asdict(s)
        d["readers"] = [g for g in GRAPHS if reads(cfg, g, s.name)]
        d["writers"] = list(GRAPHS) if s.name != "replay_start" else ["encoder_prefill"]
        state.append(d)
    return {"state": state, "static_dims": static_dims(cfg),
            "graphs": {g: {"inputs": [t.to_dict() for t in graph_inputs(cfg, g)],
                           "outputs": [t.to_dict() for t in graph_outputs(cfg, g)]} for g in GRAPHS}}
