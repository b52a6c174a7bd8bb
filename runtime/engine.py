"""Engines: one graph each, `run(inputs) -> outputs` with the contract's tensor names
(PIPELINE.md §5). The orchestration code does not know which backend it drives.

  TorchEngine  the reference model's graph function (GraphModule), CPU or GPU
  OrtEngine    a bundle's ONNX graph on ONNX Runtime (portable or plugin flavor)
Every engine checks its I/O against the contract (and, for bundles, the manifest) on load.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from dsflash.export.contract import GRAPHS, graph_inputs, graph_outputs

BACKENDS = ("torch", "ort", "ort-plugin")


class Engine(Protocol):
    graph: str
    input_names: list[str]
    output_names: list[str]

    def run(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


def _check_feeds(engine, inputs: dict) -> None:
    missing = [n for n in engine.input_names if n not in inputs]
    if missing:
        raise ValueError(f"{engine.graph} needs inputs {missing}")


class TorchEngine:
    def __init__(self, model, graph: str):
        from dsflash.export.graphs import GraphModule

        if graph not in GRAPHS:
            raise ValueError(f"unknown graph {graph!r}; graphs: {GRAPHS}")
        self.graph, self.module = graph, GraphModule(model, graph).eval()
        self.input_names, self.output_names = self.module.input_names, self.module.output_names
        contract = ([t.name for t in graph_inputs(model.cfg, graph)],
                    [t.name for t in graph_outputs(model.cfg, graph)])
        if (self.input_names, self.output_names) != contract:
            raise ValueError(f"{graph}: the model's I/O differs from the contract")

    @torch.no_grad()
    def run(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        _check_feeds(self, inputs)
        outs = self.module(*(inputs[n] for n in self.input_names))
        return dict(zip(self.output_names, outs))


class OrtEngine:
    def __init__(self, bundle, graph: str, flavor: str = "portable", providers: list[str] | None = None):
        from dsflash.export.ort_session import ort_session

        self.graph, self.flavor = graph, flavor
        self.session = ort_session(bundle, graph, flavor, providers)  # checks I/O vs the manifest
        self.input_names = [t.name for t in graph_inputs(bundle.config, graph)]
        self.output_names = [t.name for t in graph_outputs(bundle.config, graph)]

    def run(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        _check_feeds(self, inputs)
        feeds = {n: inputs[n].detach().cpu().numpy() for n in self.input_names}
        outs = self.session.run(self.output_names, feeds)
        return {n: torch.from_numpy(np.asarray(v)) for n, v in zip(self.output_names, outs)}


def make_engines(backend: str, bundle=None, model=None) -> dict[str, Engine]:
    """Both graphs' engines for a backend name."""
    if backend == "torch":
        if model is None:
            raise ValueError("the torch backend needs the reference model")
        return {g: TorchEngine(model, g) for g in GRAPHS}
    if backend in ("ort", "ort-plugin"):
        if bundle is None:
            raise ValueError(f"the {backend} backend needs a bundle")
        flavor = "plugin" if backend == "ort-plugin" else "portable"
        return {g: OrtEngine(bundle, g, flavor) for g in GRAPHS}
    raise ValueError(f"unknown backend {backend!r}; backends: {BACKENDS}")
