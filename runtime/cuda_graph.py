"""CUDA-graph capture of a step function: a decode step is dozens of small launches whose CPU
launch cost exceeds their GPU time at small batch; one graph replay removes that.

`GraphedStep(fn)` captures `fn(*tensors)` once per input signature (shapes and dtypes) after a
warm-up on a side stream (which also compiles the Triton kernels and allocates the mHC
workspace before capture), and replays it with the inputs copied into the captured buffers. The
step must be capturable: no host synchronisation and no host-to-device copies inside.

Resident inputs: the caller may name inputs that are long-lived buffers (the cache pools, fed as
views) which the graph can read where they are. Those are captured in place, not cloned, and the
graph is keyed by their addresses too, so a decode step copies only its new token ids in instead
of the whole cache (at the released sizes a sequence's cache is hundreds of MB at 128K tokens).
The caller must keep them alive and change them only between calls (the cache manager writes a
step's additions after the replay).
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class GraphedStep:
    def __init__(self, fn, warmup: int = 2, max_graphs: int = 16):
        if max_graphs < 1:
            raise ValueError(f"max_graphs={max_graphs} must be >= 1")
        self._fn, self._warmup, self._max_graphs = fn, warmup, max_graphs
        self._graphs: OrderedDict = OrderedDict()  # least recently replayed first

    @staticmethod
    def _key(inputs, resident: frozenset) -> tuple:
        shapes = tuple((tuple(t.shape), t.dtype, t.device) for t in inputs)
        places = tuple((i, inputs[i].data_ptr(), inputs[i].stride()) for i in sorted(resident))
        return shapes, places

    def _capture(self, inputs, resident: frozenset):
        static_in = [t if i in resident else t.clone() for i, t in enumerate(inputs)]
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

    def __call__(self, *inputs: torch.Tensor, resident=()):
        """Replay (capturing first if needed) on `inputs`; `resident`: positions of inputs the
        graph may read in place (see the module docstring)."""
        bad = [i for i, t in enumerate(inputs) if not (isinstance(t, torch.Tensor) and t.is_cuda)]
        if bad:
            raise ValueError(f"a CUDA-graph step takes CUDA tensors only; inputs {bad} are not")
        resident = frozenset(resident)
        if not resident <= set(range(len(inputs))):
            raise ValueError(f"resident input positions {sorted(resident)} outside the "
                             f"{len(inputs)} inputs")
        key = self._key(inputs, resident)
        if key not in self._graphs:
            if len(self._graphs) >= self._max_graphs:
                self._graphs.popitem(last=False)  # its memory returns to the caching allocator
            self._graphs[key] = self._capture(inputs, resident)
        self._graphs.move_to_end(key)
        static_in, graph, static_out = self._graphs[key]
        for i, (buf, t) in enumerate(zip(static_in, inputs)):
            if i not in resident:
                buf.copy_(t)
        graph.replay()
        # the captured outputs are overwritten by the next replay: hand out copies
        return tuple(o.clone() for o in static_out)
