"""The CPU tests' stand-in for the Triton interpreter's builtin patching (interpreter_patching.py):
installed once, listing the language's builtins, and launches through it patch and restore the
language as before, with jit helpers called in a loop."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="interpreter only")


@triton.jit
def scaled(x, step):
    return x * (step + 1) + tl.exp(x * 0.0)


@triton.jit
def helper_loop_kernel(x_ptr, out_ptr, n, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over steps of a helper's value: one helper call per step, as the kernels' loops do."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(x_ptr + offs, mask=keep, other=0.0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for step in range(STEPS):
        acc += scaled(x, step)
    tl.store(out_ptr + offs, acc, mask=keep)


def test_the_stand_in_is_installed_once_with_the_builtins_listed():
    from interpreter_patching import install_builtin_name_cache
    from triton.runtime import interpreter

    names = getattr(interpreter._patch_builtin, "cached_names", None)
    assert names is not None, "conftest did not install the stand-in"
    assert {"load", "store", "arange", "where", "reduce"} <= set(names[id(tl)])
    assert {"__add__", "to"} <= set(names[id(tl.tensor)]) and "exp" in names[id(tl.math)]
    assert install_builtin_name_cache() is False  # a second install keeps the first


def test_a_launch_with_helpers_in_a_loop_patches_and_restores_the_language(gen):
    # small integers: every product and sum is exact in fp32, so the kernel's bits must equal these
    x = torch.randint(-8, 9, (37,), generator=gen).float()
    out = torch.full_like(x, float("nan"))
    helper_loop_kernel[(triton.cdiv(37, 16),)](x, out, 37, STEPS=5, BLOCK=16)
    assert torch.equal(out, x * (1 + 2 + 3 + 4 + 5) + 5.0)
    # the launch's scope restored the builtins: the next launch patches them again
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.tensor.__add__)
    assert tl.core.is_builtin(tl.math.exp)
