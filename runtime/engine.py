"""Engines: one graph each, `run(inputs, resident=()) -> outputs` with the contract's tensor
names (PIPELINE.md §5). The orchestration code does not know which backend it drives.
`resident` names inputs that are views of long-lived buffers (the cache pools) which an engine may
read in place across calls; the TorchEngine's CUDA graphs use it, the others need no copy anyway.

  TorchEngine  the reference model's graph function (GraphModule), CPU or GPU; on the GPU
               optionally with the Triton kernels (ops="triton"), the decode step compiled by
               torch.compile (compile="inductor") and replayed as a CUDA graph (cuda_graph=True)
  OrtEngine    a bundle's ONNX graph on ONNX Runtime (portable or plugin flavor); with the
               CUDA provider, IOBinding keeps inputs, outputs and the cache on the GPU
  TrtEngine    a bundle's TensorRT plan (runtime/trt_engine.py)
Every engine checks its I/O against the contract (and, for bundles, the manifest) on load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Protocol

import numpy as np
import torch

from dsflash.export.contract import GRAPHS, graph_inputs, graph_outputs

BACKENDS = ("torch", "torch-triton", "torch-compiled", "ort", "ort-plugin", "ort-cuda", "trt")
TORCH_BACKENDS = ("torch", "torch-triton", "torch-compiled")
# inductor settings that made the small preset's compiled decode step ~1.3x faster on the H200,
# for about twice the compile time (docs/benchmarks.md, session 17: batch 1 2.84 -> 2.10-2.15 ms,
# 3.0x the graphed step; batch 32 2.4x it): every generated kernel's block sizes tuned by timing,
# and one-row matmuls lowered to reductions fused with their neighbours (inductor's mm
# decomposition does that only under this setting)
TUNED_COMPILE = MappingProxyType({"coordinate_descent_tuning": True})  # read-only


class Engine(Protocol):
    graph: str
    input_names: list[str]
    output_names: list[str]

    def run(self, inputs: dict[str, torch.Tensor], resident=()) -> dict[str, torch.Tensor]: ...


def _check_feeds(engine, inputs: dict) -> None:
    missing = [n for n in engine.input_names if n not in inputs]
    if missing:
        raise ValueError(f"{engine.graph} needs inputs {missing}")


class TorchEngine:
    def __init__(self, model, graph: str, ops: str | None = None, cuda_graph: bool = False,
                 compile: str | Callable | None = None, compile_options: Mapping | None = None):
        """ops: switch the model's op backend ("reference", "triton"); note the model's OpSet is
        shared by both graphs' engines. cuda_graph: capture and replay one-row steps (decode)
        as CUDA graphs, one per batch size (needs a CUDA model); multi-row calls (prefill
        chunks of any length) run eagerly, so graphs are not captured per prompt length.
        compile: a torch.compile backend ("inductor", or a callable) for the one-row steps,
        traced as one graph (the custom ops stay opaque: plugins/triton_ops.py) so the PyTorch
        ops between them are fused; a CUDA graph then replays the compiled step. Shapes are
        symbolic (dynamic=True), so a batch of one sequence compiles once and every larger batch
        once more (each 1-2 minutes for the small preset on the H200); prefill stays eager.
        compile_options: inductor settings for that compile (torch.compile's `options`, e.g.
        {"max_autotune_gemm": True}); only with compile="inductor"."""
        from dsflash.export.graphs import GraphModule

        if graph not in GRAPHS:
            raise ValueError(f"unknown graph {graph!r}; graphs: {GRAPHS}")
        if ops is not None:
            model.ops.backend = ops
        device = next(model.parameters()).device
        if model.ops.backend == "triton" and device.type != "cuda":
            from dsflash.plugins.launch import interpreting

            if not interpreting():  # fail here, not after a compile or deep inside the first step
                raise ValueError(f"the Triton kernels need the model on a CUDA device, not {device} "
                                 "(or TRITON_INTERPRET=1 to run them in the interpreter on the CPU)")
        self.graph, self.module = graph, GraphModule(model, graph).eval()
        self._step = self.module  # what runs one-row steps
        if compile_options and compile != "inductor":
            raise ValueError(f"compile_options {sorted(compile_options)} are inductor settings; "
                             f"compile is {compile!r}")
        if compile is not None:
            from dsflash.model.moe import MoE

            for m in model.modules():  # the trace reads each MoE's expert stack as it is
                if isinstance(m, MoE) and not m.dense:
                    m.stack_experts()
            self._step = torch.compile(self.module, backend=compile, fullgraph=True, dynamic=True,
                                       options=dict(compile_options) if compile_options else None)
        self._graphed = None
        if cuda_graph:
            if device.type != "cuda":
                raise ValueError(f"cuda_graph=True needs the model on a CUDA device, not {device}")
            from dsflash.runtime.cuda_graph import GraphedStep

            self._graphed = GraphedStep(self._step)
        self.input_names, self.output_names = self.module.input_names, self.module.output_names
        contract = ([t.name for t in graph_inputs(model.cfg, graph)],
                    [t.name for t in graph_outputs(model.cfg, graph)])
        if (self.input_names, self.output_names) != contract:
            raise ValueError(f"{graph}: the model's I/O differs from the contract")

    @torch.no_grad()
    def run(self, inputs: dict[str, torch.Tensor], resident=()) -> dict[str, torch.Tensor]:
        _check_feeds(self, inputs)
        tensors = [inputs[n] for n in self.input_names]
        one_row = inputs["ids"].shape[1] == 1
        if self._graphed is not None and one_row:
            at = [i for i, n in enumerate(self.input_names) if n in set(resident)]
            outs = self._graphed(*tensors, resident=at)
        else:
            outs = (self._step if one_row else self.module)(*tensors)
        return dict(zip(self.output_names, outs))


class OrtEngine:
    """A bundle graph on ONNX Runtime. With the CUDA provider (onnxruntime-gpu), inputs and outputs
    stay on the GPU: IOBinding hands ONNX Runtime the torch tensors' device pointers, and outputs
    are preallocated torch tensors of the contract's shapes, so a device-resident cache is never
    copied to the host."""

    def __init__(self, bundle, graph: str, flavor: str = "portable", providers: list[str] | None = None):
        from dsflash.export.ort_session import asks_for_cuda, ort_session, require_cuda

        self.graph, self.flavor, self.cfg = graph, flavor, bundle.config
        self.dtype = bundle.dtype  # the "model" ports' dtype (a bf16 bundle's state and outputs)
        self.session = ort_session(bundle, graph, flavor, providers)  # checks I/O vs the manifest
        self.inputs = graph_inputs(bundle.config, graph)
        self.outputs = graph_outputs(bundle.config, graph)
        self.input_names = [t.name for t in self.inputs]
        self.output_names = [t.name for t in self.outputs]
        self.on_cuda = "CUDAExecutionProvider" in self.session.get_providers()
        if asks_for_cuda(providers):
            require_cuda(self.session, graph)

    def run(self, inputs: dict[str, torch.Tensor], resident=()) -> dict[str, torch.Tensor]:
        _check_feeds(self, inputs)
        for spec in self.inputs:  # before ONNX Runtime, whose own error names no dtype we know
            want, got = spec.torch_dtype(self.dtype), inputs[spec.name].dtype
            if got != want:
                raise ValueError(f"{self.graph}: input {spec.name} is {got}, but this bundle's graph "
                                 f"takes {want} (a cache allocated in another dtype than the bundle's?)")
        if self.on_cuda:
            return self._run_bound(inputs)
        # contiguous: a run of cache slots is a strided view of the window rings
        feeds = {n: inputs[n].detach().cpu().contiguous().numpy() for n in self.input_names}
        outs = self.session.run(self.output_names, feeds)
        return {n: torch.from_numpy(np.asarray(v)) for n, v in zip(self.output_names, outs)}

    def _run_bound(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        device = torch.device("cuda", torch.cuda.current_device())
        binding = self.session.io_binding()
        feeds = {n: inputs[n].detach().to(device).contiguous() for n in self.input_names}
        for n, t in feeds.items():
            binding.bind_input(n, "cuda", device.index, _element_type(t.dtype), tuple(t.shape), t.data_ptr())
        ids = feeds["ids"]
        outs = {}
        for spec in self.outputs:  # output shapes depend on B and S only (see the contract)
            shape = spec.resolve(self.cfg, ids.shape[0], 0, ids.shape[1])
            t = torch.empty(shape, dtype=spec.torch_dtype(self.dtype), device=device)
            binding.bind_output(spec.name, "cuda", device.index, _element_type(t.dtype), shape, t.data_ptr())
            outs[spec.name] = t
        torch.cuda.current_stream().synchronize()  # ONNX Runtime runs on its own stream
        self.session.run_with_iobinding(binding)
        return outs


def _element_type(dtype: torch.dtype) -> int:
    """IOBinding's element type as ONNX's enum, which ONNX Runtime takes since 1.20 (its
    microsoft/onnxruntime#22306): numpy has no bfloat16, so a bf16 bundle cannot be bound by
    numpy dtype."""
    from onnx import TensorProto

    types = {torch.float32: TensorProto.FLOAT, torch.bfloat16: TensorProto.BFLOAT16,
             torch.float16: TensorProto.FLOAT16, torch.int64: TensorProto.INT64,
             torch.bool: TensorProto.BOOL, torch.uint8: TensorProto.UINT8, torch.int8: TensorProto.INT8}
    if dtype not in types:
        raise ValueError(f"no ONNX element type for {dtype} (binds {sorted(map(str, types))})")
    return types[dtype]


def make_engines(backend: str, bundle=None, model=None, compile_options: Mapping | None = None
                 ) -> dict[str, Engine]:
    """Both graphs' engines for a backend name. compile_options: inductor settings for the
    torch-compiled backend's decode step (TorchEngine; e.g. TUNED_COMPILE)."""
    if compile_options is not None and backend != "torch-compiled":
        raise ValueError(f"compile_options are for the torch-compiled backend, not {backend!r}")
    if backend in TORCH_BACKENDS:
        if model is None:
            raise ValueError(f"the {backend} backend needs the reference model")
        if backend == "torch":  # the reference ops, whatever the shared OpSet ran before
            return {g: TorchEngine(model, g, ops="reference") for g in GRAPHS}
        # the kernels; on a GPU the decode step (fixed shapes per batch size) becomes a CUDA graph;
        # torch-compiled compiles it first (inductor fuses the ops between the kernels)
        on_gpu = next(model.parameters()).is_cuda
        compiled = "inductor" if backend == "torch-compiled" else None
        return {g: TorchEngine(model, g, ops="triton", cuda_graph=on_gpu and g == "decoder_step",
                               compile=compiled if g == "decoder_step" else None,
                               compile_options=compile_options if g == "decoder_step" else None)
                for g in GRAPHS}
    if backend in ("ort", "ort-plugin", "ort-cuda"):
        if bundle is None:
            raise ValueError(f"the {backend} backend needs a bundle")
        flavor = "plugin" if backend == "ort-plugin" else "portable"
        from dsflash.export.ort_session import cuda_providers

        providers = cuda_providers() if backend == "ort-cuda" else None
        return {g: OrtEngine(bundle, g, flavor, providers) for g in GRAPHS}
    if backend == "trt":
        if bundle is None:
            raise ValueError("the trt backend needs a bundle with plans")
        from dsflash.runtime.trt_engine import TrtEngine

        return {g: TrtEngine(bundle, g) for g in GRAPHS}
    raise ValueError(f"unknown backend {backend!r}; backends: {BACKENDS}")
