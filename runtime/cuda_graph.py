"""CUDA-graph capture of a step function: a decode step is dozens of small launches whose CPU
launch cost exceeds their GPU time at small batch; one graph replay removes that.

`GraphedStep(fn)` captures `fn(*tensors)` once per input signature (shapes and dtypes) after a
warm-up on a side stream (which also compiles the Triton kernels and allocates the mHC
workspace before capture), and replays it with the inputs copied into the captured buffers. The
step must be capturable: no host synchronisation and no host-to-device copies inside.
"""

from __future__ import annotations

import torch


class GraphedStep:
    def __init__(self, fn, warmup: int = 2):
        self._fn, self._warmup = fn, warmup
        self._graphs: dict = {}

    @staticmethod
    def _signature(inputs) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)

    def _capture(self, inputs):
        static_in = [t.clone() for t in inputs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self._warmup):
                self._fn(*static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self._fn(*static_in)
        return static_in, graph, static_out

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def __call__(self, *inputs: torch.Tensor):
        bad = [i for i, t in enumerate(inputs) if not (isinstance(t, torch.Tensor) and t.is_cuda)]
        if bad:
            raise ValueError(f"a CUDA-graph step takes CUDA tensors only; inputs {bad} are not")
        key = self._signature(inputs)
        if key not in self._graphs:
            self._graphs[key] = self._capture(inputs)
        static_in, graph, static_out = self._graphs[key]
        for buf, t in zip(static_in, inputs):
            buf.copy_(t)
        graph.replay()
        # the captured outputs are overwritten by the next replay: hand out copies
        return tuple(o.clone() for o in static_out)
