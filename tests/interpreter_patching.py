"""A faster stand-in for the Triton interpreter's builtin patching, for the CPU tests.

Under TRITON_INTERPRET=1, triton 3.6 patches the language (`triton.language`, its tensor class,
`tl.math`, ...) at every launch and again at every call of one @triton.jit function from another
(runtime/interpreter.py: `InterpretedFunction.__call__` -> `_patch_lang` -> `_patch_builtin`).
`_patch_builtin` finds the builtins with `inspect.getmembers` over the whole module or class each
time; the kernels here call helpers in their loops, so that scan took 25 s of 82 s in two of the
top-k collect tests (cProfile, 2026-12-08: 19,376 helper calls, 102,893 scans).

The stand-in does the same patching from the names of each package's builtins, listed once while
the language is still unpatched: a member that is no builtin now (already patched by the running
launch) is skipped, as the original skips it, and a package whose first listed builtin is patched
is skipped whole. Packages it has not listed go to the original.
"""

from __future__ import annotations

import inspect


def install_builtin_name_cache() -> bool:
    """Swap triton's `_patch_builtin` for one that reads cached builtin names; -> whether it was
    installed (False where this triton has no such function, or the language is patched now)."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if original is None or patch_attr is None or getattr(original, "cached_names", None) is not None:
        return False
    packages = (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
    if not all(tl.core.is_builtin(getattr(tl, name)) for name in ("load", "store", "arange")):
        return False  # a launch is patching the language: its members are not the builtins now
    names = {id(pkg): [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
             for pkg in packages}

    def patch_builtin(pkg, builder, scope):
        listed = names.get(id(pkg))
        if listed is None:
            return original(pkg, builder, scope)
        # one call patches all of a package's builtins and the launch's scope restores them all:
        # one member that is no builtin now says the running launch has patched the package
        if listed and not tl.core.is_builtin(getattr(pkg, listed[0])):
            return None
        for name in listed:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)
        return None

    patch_builtin.cached_names = names
    interpreter._patch_builtin = patch_builtin
    return True
