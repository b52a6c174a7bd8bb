"""Ahead-of-time compilation of the Triton kernels for TensorRT's AOT Python plugins
(PIPELINE.md §6): triton.compile(ASTSource(...), target sm_90) gives PTX, the kernel's name, its
warps and shared memory; trt.py beside each kernel turns that into `tensorrt.plugin` launch
parameters. Nothing here needs TensorRT or a GPU, so the step is tested on every machine.

TensorRT launches an AOT kernel with its input tensors, then the integer `extra_args`, then the
output tensors; every kernel.py entry point is declared in that order.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch

TRITON_POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
                  torch.int64: "*i64", torch.int32: "*i32", torch.bool: "*u8", torch.uint8: "*u8",
                  torch.float8_e4m3fn: "*fp8e4nv"}


@dataclass(frozen=True)
class AotKernel:
    name: str          # the PTX entry
    ptx: str
    num_warps: int
    shared_mem: int    # dynamic shared memory bytes the launch must give
    params: int        # .param entries of the entry (the declared ones + Triton's scratch pointers)
    declared: int      # the kernel's non-constexpr parameters (what TensorRT passes)
    global_scratch: int  # bytes of Triton global scratch the kernel needs (TensorRT gives none)
    aligned: bool = False  # compiled for 16-byte aligned pointers (vector loads, async copies)

    @property
    def block_x(self) -> int:
        return 32 * self.num_warps


@dataclass(frozen=True)
class AotLaunch:
    """What a plugin's aot_impl hands TensorRT, over plain ints (a test's concrete shapes: what
    plugins/ptx_launch.py launches) or TensorRT's symbolic shape expressions (the build): the
    compiled kernel, the grid (x, y, z) and the int32 arguments passed between the input and the
    output pointers."""
    kernel: AotKernel
    grid: tuple
    extra: tuple

    def for_trt(self, trtp) -> tuple:
        """(kernel name, PTX, KernelLaunchParams, SymIntExprs): an aot_impl's return value."""
        launch = trtp.KernelLaunchParams()
        launch.grid_x, launch.grid_y, launch.grid_z = self.grid
        launch.block_x = self.kernel.block_x
        launch.shared_mem = self.kernel.shared_mem
        extra = trtp.SymIntExprs(len(self.extra))
        for i, e in enumerate(self.extra):
            extra[i] = trtp.SymInt32(e)
        return self.kernel.name, self.kernel.ptx, launch, extra


def constant(dim) -> int:
    """A dimension that must be known when the kernel compiles: an int, or a TensorRT shape
    expression with a constant value (heads, head dims, hidden sizes of the network)."""
    return dim if isinstance(dim, int) else int(dim.constant_value())


def pointer(dtype: torch.dtype) -> str:
    if dtype not in TRITON_POINTER:
        raise ValueError(f"no Triton pointer type for {dtype}; supported: {list(TRITON_POINTER)}")
    return TRITON_POINTER[dtype]


def jit_function(kernel):
    """The JITFunction behind a kernel; under TRITON_INTERPRET=1 kernels are interpreter objects,
    which cannot be compiled: AOT needs a process without the interpreter."""
    from triton.runtime.jit import JITFunction

    if not isinstance(kernel, JITFunction):
        raise RuntimeError(f"{kernel!r} is not a JITFunction (TRITON_INTERPRET=1?); compile ahead of "
                           "time in a process without the interpreter")
    return kernel


def with_defaults(fn, constexprs: dict) -> dict:
    """The constants, with those the kernel gives a default for filled in (PDL: off for
    TensorRT, which launches the kernel itself)."""
    return {name: p.default for name, p in inspect.signature(fn.fn).parameters.items()
            if p.default is not inspect.Parameter.empty} | dict(constexprs)


def compile_kernel(kernel, signature: dict, constexprs: dict, num_warps: int, arch: int = 90,
                   num_stages: int | None = None, divisible_by_16: tuple = (), maxnreg: int | None = None):
    """Triton's compiled kernel (its PTX, TTGIR and metadata) for `arch` (sm_90 by default) of
    `kernel` with `signature` (name -> Triton type, in the kernel's parameter order) and the
    compile-time constants; num_stages None: Triton's default. divisible_by_16 names the
    parameters to specialise as the JIT does for aligned pointers and sizes that are multiples
    of 16 (what decides 16-byte vector loads and copies). Gluon kernels (gluon.jit) compile from
    their own source class; maxnreg caps the registers per thread (a warp-specialized kernel's
    budget, written into the PTX as .maxnreg)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = jit_function(kernel)
    constexprs = with_defaults(fn, constexprs)
    missing = [a for a in fn.arg_names if a not in signature and a not in constexprs]
    if missing:
        raise ValueError(f"{fn.__name__}: no type or constant for {missing}")
    sig = {a: ("constexpr" if a in constexprs else signature[a]) for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible_by_16}
    source = GluonASTSource if fn.is_gluon() else ASTSource
    src = source(fn=fn, signature=sig, constexprs={a: constexprs[a] for a in constexprs}, attrs=attrs)
    options = {"num_warps": num_warps} | ({} if num_stages is None else {"num_stages": num_stages}) \
        | ({} if maxnreg is None else {"maxnreg": maxnreg})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def compile_ptx(kernel, signature: dict, constexprs: dict, num_warps: int, arch: int = 90,
                num_stages: int | None = None, aligned: bool = False,
                maxnreg: int | None = None) -> AotKernel:
    """PTX for `arch` (sm_90 by default) of `kernel` with `signature` (name -> Triton type, in the
    kernel's parameter order), the compile-time constants and the launch config's pipeline depth
    (None: Triton's default). aligned: every pointer is taken as 16-byte aligned, as Triton's JIT
    does when it sees such pointers (16-byte vector loads and asynchronous copies; a misaligned
    pointer then faults with a misaligned-address error); sizes are never specialised."""
    fn = jit_function(kernel)
    constexprs = with_defaults(fn, constexprs)
    pointers = tuple(a for a, t in signature.items() if t.startswith("*")) if aligned else ()
    compiled = compile_kernel(kernel, signature, constexprs, num_warps, arch, num_stages=num_stages,
                              divisible_by_16=pointers, maxnreg=maxnreg)
    ptx = compiled.asm["ptx"]
    entry = ptx.split(".entry", 1)[1].split(")", 1)[0]
    return AotKernel(name=compiled.metadata.name, ptx=ptx, num_warps=compiled.metadata.num_warps,
                     shared_mem=compiled.metadata.shared, params=entry.count(".param"),
                     declared=sum(1 for a in fn.arg_names if a not in constexprs),
                     global_scratch=int(getattr(compiled.metadata, "global_scratch_size", 0)),
                     aligned=aligned)


def cdiv_expr(a, b: int):
    """Ceiling division that works on ints and on TensorRT's symbolic shape expressions."""
    return (a + (b - 1)) // b


def pipelined_copies(ttgir: str) -> list[tuple[tuple[int, ...], str]]:
    """(shape, element type) of every asynchronous global-to-shared copy (Triton's software
    pipeline of a loop's loads) in a TTGIR listing, e.g. ((64, 16), "bf16")."""
    found = re.findall(r"ttg\.async_copy_global_to_local\b[^\n]*?: tensor<((?:\d+x)+)!tt\.ptr<(\w+)>", ttgir)
    return [(tuple(int(d) for d in dims.rstrip("x").split("x")), elem) for dims, elem in found]


def loop_async_waits(ttgir: str) -> list[list[int]]:
    """For each loop (scf.for) of a TTGIR listing in order, the `num` of every async_wait between
    its head and its first scf.yield: how many asynchronous copy groups the step leaves in flight
    when it waits (0: it waits for every copy it issued). Meant for loops without inner loops."""
    bodies = [part.split("scf.yield", 1)[0] for part in ttgir.split("scf.for")[1:]]
    return [[int(n) for n in re.findall(r"ttg\.async_wait\b[^\n]*\{num = (\d+)", body)] for body in bodies]


def operand_loads(ttgir: str) -> list[tuple[tuple[int, ...], str, int]]:
    """(shape, element type, operand index) of every shared-memory load into a tensor-core dot
    operand's register layout in a TTGIR listing, e.g. ((64, 32), "f32", 0)."""
    found = re.findall(r"ttg\.local_load\b[^\n]*-> tensor<((?:\d+x)+)(\w+), "
                       r"#ttg\.dot_op<\{opIdx = (\d)", ttgir)
    return [(tuple(int(d) for d in dims.rstrip("x").split("x")), elem, int(idx)) for dims, elem, idx in found]
