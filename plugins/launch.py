"""Checks shared by the Triton launchers: every precondition raises ValueError naming the value
and its limit before anything is launched (a bad index inside a kernel is silent garbage).

Kernels run on CUDA tensors, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1),
which is how CI tests them without a GPU.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# The checks below run on every launch (eager prefill runs hundreds per step), so each builds its
# message only when it fails: formatting them all cost MhcBoundary's launcher about a third of its
# host time (cProfile, session 13).


def check_device(op: str, **tensors: torch.Tensor) -> None:
    """All tensors on one CUDA device; CPU only under the interpreter. A pinned host tensor may
    stand in for a device one where the op says so (read through unified addressing)."""
    want = "cpu" if interpreting() else "cuda"
    for name, t in tensors.items():
        if t.device.type != want:
            hint = " (set TRITON_INTERPRET=1 to run kernels on the CPU)" if want == "cuda" else ""
            raise ValueError(f"{op}: {name} is on {t.device}, the kernel needs {want} tensors{hint}")


def check_interpreter_dot(op: str, **tensors: torch.Tensor) -> None:
    """Under the interpreter, no bf16 operands for a kernel whose products use tl.dot: the
    interpreter computes bf16 dot products wrongly (CPU, triton 3.6: Csa2SparseAttention gave
    values near 8e8 for outputs of magnitude ~1, Csa2IndexScore 2.5e10), so the launch refuses
    them rather than return garbage. fp32 runs correctly there; bf16 runs on a GPU."""
    if not interpreting():
        return
    for name, t in tensors.items():
        if t.dtype == torch.bfloat16:
            raise ValueError(f"{op}: {name} is bfloat16, which the Triton interpreter cannot "
                             "multiply correctly; use float32 on the CPU, or bfloat16 on a GPU")


def check_shape(op: str, name: str, t: torch.Tensor, shape: tuple) -> None:
    """`shape` entries of None match anything."""
    got = t.shape
    ok = len(got) == len(shape)
    for g, w in zip(got, shape):  # a plain loop: any() over a generator took twice as long
        if w is not None and w != g:
            ok = False
    if not ok:
        raise ValueError(f"{op}: {name} has shape {tuple(got)}, expected {shape} (None = any)")


def check_dtype(op: str, name: str, t: torch.Tensor, allowed: tuple) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}, allowed: {allowed}")


def next_pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def is_pow2(value, zero_ok: bool = False) -> bool:
    """Whether `value` is an int power of two (tl.arange's sizes), or 0 where `zero_ok` (a
    setting that switches something off); booleans are not sizes."""
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return (value >= 1 and value & (value - 1) == 0) or (zero_ok and value == 0)


FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HALF_FLOATS = (torch.bfloat16, torch.float16)  # 16-bit operands (tensor-core tiles, async copies)


class LauncherBase:
    """What the launchers with a self-clearing workspace share: the workspaces, the GPU's
    multiprocessor count (to size split grids) and launch-parameter overrides (benchmark sweeps)."""

    def __init__(self, sm_count: int | None = None, overrides: dict | None = None):
        self._ws: dict = {}
        self._retired: list = []
        self._sm_count = sm_count
        self._overrides = dict(overrides or {})

    def _reuse_or_make(self, key, fits, make):
        """The workspace under `key` if `fits(ws)`, else a new one from `make()`. A replaced
        workspace is kept, never freed: a CUDA graph captured with it (the runtime's decode step)
        reads and writes those addresses on every replay, and freed memory would go to other
        tensors, e.g. when an eager prefill grows the workspace after a decode step was captured.
        Callers size workspaces in powers of two, so few are ever replaced."""
        ws = self._ws.get(key)
        if ws is None or not fits(ws):
            if ws is not None:
                self._retired.append(ws)
            ws = make()
            self._ws[key] = ws
        return ws

    def _sms(self, device: torch.device) -> int:
        if self._sm_count is None:
            self._sm_count = (torch.cuda.get_device_properties(device).multi_processor_count
                              if device.type == "cuda" else 4)
        return self._sm_count
