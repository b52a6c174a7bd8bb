"""Run an AOT plugin kernel the way TensorRT runs it, without TensorRT: load the PTX that a trt.py
`aot_launch` hands TensorRT through the CUDA driver (which JIT-compiles it for the device), and
launch it with that launch's grid, block and dynamic shared memory, passing the input pointers, the
int32 extra arguments and the output pointers in TensorRT's order. This checks on any CUDA machine
what an engine build would embed: the PTX, the parameter order, the grid expressions and the extra
arguments (tests/test_aot_gpu.py compares every plugin kernel with its reference this way;
scripts/bench_aot.py times them against the JIT launchers).

Triton's PTX declares two scratch pointers after the kernel's own parameters; these kernels need
no scratch (plugins/aot.py records global_scratch == 0), so they get null. A kernel asking for more
than 48 KB of dynamic shared memory must be opted in (cuFuncSetAttribute), as every CUDA launcher
must; `PtxKernel.opt_in` says whether that was needed. A kernel compiled for 16-byte aligned
pointers (AotKernel.aligned, the plugins' default) is refused misaligned tensors here; in an
engine it would fault with a misaligned-address error.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence

import torch

from dsflash.plugins.aot import AotLaunch

DEFAULT_DYNAMIC_SHARED = 48 * 1024  # what a launch gets without opting in (CUDA programming guide)
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # cuda.h, CUfunction_attribute


def ptx_param_types(ptx: str, entry: str) -> list[str]:
    """The .param types of `entry` in order, e.g. ["u64", "u64", "u32", ...]."""
    match = re.search(rf"\.entry\s+{re.escape(entry)}\s*\((.*?)\)", ptx, re.DOTALL)
    if match is None:
        raise ValueError(f"no .entry {entry} in the PTX")
    return re.findall(r"\.param\s+\.(\w+)", match.group(1))


class CudaDriver:
    """The few CUDA driver calls a PTX launch needs, through ctypes (libcuda.so.1)."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"the CUDA driver library libcuda.so.1 cannot be loaded: {e}") from e

    def check(self, result: int, what: str) -> None:
        if result != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(result, ctypes.byref(name))
            raise RuntimeError(f"{what} failed: {name.value.decode() if name.value else result}")

    def call(self, fn: str, *args) -> None:
        self.check(getattr(self.lib, fn)(*args), fn)


class PtxKernel:
    """One AOT kernel loaded into the current CUDA context of `device` (torch's primary context)."""

    def __init__(self, launch: AotLaunch, device: torch.device | str = "cuda") -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"PtxKernel needs a CUDA device, got {device}")
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)
        torch.cuda.synchronize(self.device)  # initialises torch's context and makes it current
        self.kernel = launch.kernel
        self.params = ptx_param_types(self.kernel.ptx, self.kernel.name)
        if self.kernel.global_scratch:
            raise ValueError(f"{self.kernel.name} needs {self.kernel.global_scratch} B of global scratch, "
                             "which TensorRT does not give an AOT kernel")
        limit = torch.cuda.get_device_properties(self.device).shared_memory_per_block_optin
        if self.kernel.shared_mem > limit:
            raise ValueError(f"{self.kernel.name} needs {self.kernel.shared_mem} B of shared memory; "
                             f"{self.device} gives at most {limit} B per block")
        self.driver = CudaDriver()
        self.module, self.function = ctypes.c_void_p(), ctypes.c_void_p()
        image = ctypes.create_string_buffer(self.kernel.ptx.encode())  # NUL-terminated
        self.driver.call("cuModuleLoadDataEx", ctypes.byref(self.module), image, 0, None, None)
        self.driver.call("cuModuleGetFunction", ctypes.byref(self.function), self.module,
                         self.kernel.name.encode())
        self.opt_in = self.kernel.shared_mem > DEFAULT_DYNAMIC_SHARED
        if self.opt_in:
            self.driver.call("cuFuncSetAttribute", self.function,
                             CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.kernel.shared_mem)

    def close(self) -> None:
        if self.module:
            self.driver.call("cuModuleUnload", self.module)
            self.module = ctypes.c_void_p()

    def __enter__(self) -> PtxKernel:  # noqa: PYI034 (Self needs Python 3.11)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _arguments(self, inputs: Sequence[torch.Tensor], extra: Sequence[int],
                   outputs: Sequence[torch.Tensor]) -> list:
        declared = [*inputs, *extra, *outputs]
        if len(declared) != self.kernel.declared:
            raise ValueError(f"{self.kernel.name} declares {self.kernel.declared} parameters, got "
                             f"{len(inputs)} inputs + {len(extra)} extra + {len(outputs)} outputs")
        values = []
        for i, (arg, kind) in enumerate(zip(declared, self.params, strict=False)):
            if isinstance(arg, torch.Tensor):
                if kind != "u64":
                    raise ValueError(f"{self.kernel.name} parameter {i} is .{kind}, got a tensor")
                if arg.device != self.device or not arg.is_contiguous():
                    raise ValueError(f"{self.kernel.name} parameter {i}: a contiguous tensor on "
                                     f"{self.device} is needed, got one on {arg.device} "
                                     f"(contiguous: {arg.is_contiguous()})")
                if self.kernel.aligned and arg.data_ptr() % 16:
                    raise ValueError(f"{self.kernel.name} parameter {i}: address {arg.data_ptr():#x} is not "
                                     "16-byte aligned, which the kernel was compiled for")
                values.append(ctypes.c_uint64(arg.data_ptr()))
            else:
                if kind not in ("u32", "b32", "s32"):
                    raise ValueError(f"{self.kernel.name} parameter {i} is .{kind}, got the int {arg}")
                if not -2**31 <= int(arg) < 2**31:
                    raise ValueError(f"{self.kernel.name} parameter {i}: {arg} does not fit int32")
                values.append(ctypes.c_int32(int(arg)))
        # Triton's scratch pointers after the declared parameters: unused by these kernels
        values += [ctypes.c_uint64(0) for _ in self.params[len(declared):]]
        return values

    def __call__(self, launch: AotLaunch, inputs: Sequence[torch.Tensor],
                 outputs: Sequence[torch.Tensor]) -> None:
        """Launch on torch's current stream with `launch`'s grid and extra arguments (ints)."""
        if launch.kernel.name != self.kernel.name or launch.kernel.ptx != self.kernel.ptx:
            raise ValueError(f"the launch is for {launch.kernel.name}, this module holds a different kernel")
        grid = [int(g) for g in launch.grid]
        if min(grid) < 0 or grid[0] >= 2**31 or max(grid[1:]) > 65535:
            raise ValueError(f"{self.kernel.name}: grid {grid} is outside CUDA's limits "
                             "(x < 2^31, y, z <= 65535)")
        values = self._arguments(inputs, [int(e) for e in launch.extra], outputs)
        if min(grid) == 0:
            return  # an empty tensor: nothing to launch
        pointers = (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p)
                                                      for v in values))
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        self.driver.call("cuLaunchKernel", self.function, *(ctypes.c_uint(g) for g in grid),
                         ctypes.c_uint(self.kernel.block_x), ctypes.c_uint(1), ctypes.c_uint(1),
                         ctypes.c_uint(self.kernel.shared_mem), stream, pointers, None)
