"""TrtEngine: a bundle's TensorRT plan (plugin flavor, built by scripts/build_engines.py) through
the full `tensorrt` runtime or `tensorrt_lean`. Plans hold the plugins' PTX (AOT plugins), so
the runtime needs no Python plugin code.

On load it checks that the plan exists, that its sidecar names the bundle's current plugin ONNX
(a stale plan is refused), and that the engine's I/O names and dtypes match the contract. Inputs
and outputs are CUDA torch tensors bound by address; outputs are allocated at the shapes the
execution context reports for the given inputs.
"""

from __future__ import annotations

import json

import torch

from dsflash.export.bundle import Bundle, BundleError, sha256_file
from dsflash.export.contract import graph_inputs, graph_outputs
from dsflash.export.trt_build import PLAN_DIR, SIDECAR
from dsflash.plugins.trt_types import torch_dtypes
from dsflash.runtime.engine import _check_feeds


def import_tensorrt():
    """The full runtime if installed, else the lean one; a clear error if neither imports."""
    try:
        import tensorrt as trt
    except ImportError:
        try:
            import tensorrt_lean as trt
        except ImportError:
            raise RuntimeError("TrtEngine needs `tensorrt` or `tensorrt_lean` "
                               "(pip install tensorrt-lean)") from None
    return trt


def checked_plan(bundle: Bundle, graph: str):
    """Path of the plan for `graph`, after checking the sidecar against the bundle's ONNX."""
    side = bundle.path / PLAN_DIR / SIDECAR
    plan = bundle.path / PLAN_DIR / f"{graph}.plan"
    if not plan.is_file() or not side.is_file():
        raise BundleError(f"bundle {bundle.path} has no TensorRT plan for {graph} ({plan} or {side} is "
                          "missing); build it with scripts/build_engines.py on a machine with TensorRT")
    entry = json.loads(side.read_text()).get(graph)
    if entry is None:
        raise BundleError(f"{side} has no entry for {graph}")
    onnx_path = bundle.graph_path(graph, "plugin")
    if entry["onnx_sha256"] != sha256_file(onnx_path):
        raise BundleError(f"the {graph} plan was built from another {onnx_path.name} (sha256 differs): "
                          "rebuild the plan")
    if entry["plan_sha256"] != sha256_file(plan):
        raise BundleError(f"{plan} does not match its sha256 in {side} (modified or corrupted)")
    return plan


class TrtEngine:
    def __init__(self, bundle: Bundle, graph: str, device: int = 0):
        plan = checked_plan(bundle, graph)  # before TensorRT: a missing or stale plan is the usual error
        trt = import_tensorrt()
        self.graph, self.cfg, self.device = graph, bundle.config, torch.device("cuda", device)
        self.input_names = [t.name for t in graph_inputs(bundle.config, graph)]
        self.output_names = [t.name for t in graph_outputs(bundle.config, graph)]
        self._trt = trt
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = self._runtime.deserialize_cuda_engine(plan.read_bytes())
        if self._engine is None:
            raise BundleError(f"TensorRT {trt.__version__} could not deserialize {plan} (built with another "
                              "version or for another GPU?)")
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        mode = trt.TensorIOMode.INPUT
        ins = [n for n in names if self._engine.get_tensor_mode(n) == mode]
        outs = [n for n in names if self._engine.get_tensor_mode(n) != mode]
        if sorted(ins) != sorted(self.input_names) or sorted(outs) != sorted(self.output_names):
            raise BundleError(f"{plan.name}: engine I/O {ins} -> {outs} differs from the contract "
                              f"{self.input_names} -> {self.output_names}")
        self._context = self._engine.create_execution_context()

    def _torch_dtype(self, name: str) -> torch.dtype:
        return torch_dtypes(self._trt)[self._engine.get_tensor_dtype(name)]

    def run(self, inputs: dict[str, torch.Tensor], resident=()) -> dict[str, torch.Tensor]:
        _check_feeds(self, inputs)  # resident inputs need nothing here: every call binds addresses
        feeds = {}
        for n in self.input_names:
            t = inputs[n].to(self.device, self._torch_dtype(n)).contiguous()
            if not self._context.set_input_shape(n, tuple(t.shape)):
                raise ValueError(f"{self.graph}: input {n} of shape {tuple(t.shape)} is outside the plan's "
                                 f"profile {self._engine.get_tensor_profile_shape(n, 0)}")
            self._context.set_tensor_address(n, t.data_ptr())
            feeds[n] = t
        outs = {}
        for n in self.output_names:
            shape = tuple(self._context.get_tensor_shape(n))
            outs[n] = torch.empty(shape, dtype=self._torch_dtype(n), device=self.device)
            self._context.set_tensor_address(n, outs[n].data_ptr())
        stream = torch.cuda.current_stream(self.device)
        if not self._context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to run {self.graph}")
        return outs
