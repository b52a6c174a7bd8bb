"""Runs every plugin's `register()` (the trt.py closures TensorRT calls: shape function, autotune,
aot_impl) against stand-ins for `tensorrt` and `tensorrt.plugin`, since no TensorRT builder
installs on the project's machines. Run as a script by tests/test_trt_registration.py (the AOT
compile needs a process without the Triton interpreter).

The stand-in's shape expressions behave as tensorrt.plugin's ShapeExpr does where it matters:
arithmetic only with the expression on the left (ShapeExpr defines no reflected operators),
cdiv / min / max as module functions that refuse two ints, `constant_value()` only for build-time
constants. Each carries the value it stands for, so every symbolic result is compared with the
same function over ints: the declaration's shape function, and the plugin's aot_launch.
"""

from __future__ import annotations

import inspect
import sys
import types

import numpy as np
import torch


class Expr:
    def __init__(self, value: int, const: bool = False):
        self.value, self.const = value, const

    def _op(self, other, fn):
        if isinstance(other, Expr):
            return Expr(fn(self.value, other.value), self.const and other.const)
        if not isinstance(other, int):
            raise TypeError(f"ShapeExpr arithmetic with {type(other).__name__}")
        return Expr(fn(self.value, other), self.const)

    def __add__(self, other):
        return self._op(other, lambda a, b: a + b)

    def __sub__(self, other):
        return self._op(other, lambda a, b: a - b)

    def __mul__(self, other):
        return self._op(other, lambda a, b: a * b)

    def __floordiv__(self, other):
        return self._op(other, lambda a, b: a // b)

    @property
    def is_constant(self) -> bool:
        return self.const

    def constant_value(self) -> int:
        if not self.const:
            raise RuntimeError("Not accessible for non-constant shape expressions")
        return self.value


def value(x):
    return x.value if isinstance(x, Expr) else x


def module_fn(fn):
    def call(a, b):
        if isinstance(a, int) and isinstance(b, int):
            raise ValueError("both arguments are ints")  # noqa: TRY004 (as tensorrt.plugin raises)
        const = all(not isinstance(x, Expr) or x.const for x in (a, b))
        return Expr(fn(value(a), value(b)), const)
    return call


def size_functions() -> dict:
    """tensorrt.plugin's cdiv / min / max over stand-in expressions."""
    return {"cdiv": module_fn(lambda a, b: -(-a // b)), "min": module_fn(min), "max": module_fn(max)}


class Desc:
    def __init__(self, shape, dtype):
        self.shape_expr, self.dtype = tuple(shape), dtype

    def like(self):
        return Desc(self.shape_expr, self.dtype)


class Params:
    grid_x = grid_y = grid_z = block_x = shared_mem = None


class SymIntExprs(list):
    def __init__(self, n):
        super().__init__([None] * n)


def install() -> dict:
    """Put the stand-ins in sys.modules; returns the registry (kind, plugin id) -> function."""
    registry = {}

    def decorator(kind):
        def for_id(plugin_id):
            def keep(fn):
                assert (kind, plugin_id) not in registry, f"{plugin_id} registered twice"
                registry[(kind, plugin_id)] = fn
                return fn
            return keep
        return for_id

    trtp = types.ModuleType("tensorrt.plugin")
    trtp.register, trtp.autotune, trtp.aot_impl = (decorator(k) for k in ("register", "autotune", "aot"))
    trtp.TensorDesc = Desc
    trtp.from_shape_expr = lambda shape, dtype: Desc(shape, dtype)
    trtp.AutoTuneCombination = lambda io, layout, tactics=None: (io, layout, tactics)
    trtp.KernelLaunchParams, trtp.SymIntExprs = Params, SymIntExprs
    trtp.SymInt32 = lambda e: ("SymInt32", value(e))
    for name, fn in size_functions().items():
        setattr(trtp, name, fn)
    trt = types.ModuleType("tensorrt")
    trt.DataType = types.SimpleNamespace(FLOAT="FLOAT", HALF="HALF", BF16="BF16", INT64="INT64",
                                         INT32="INT32", BOOL="BOOL", UINT8="UINT8", INT8="INT8")
    trt.float32 = "FLOAT"
    trt.plugin = trtp
    sys.modules["tensorrt"], sys.modules["tensorrt.plugin"] = trt, trtp
    return registry


TORCH_TO_TRT = {torch.bfloat16: "BF16", torch.float32: "FLOAT", torch.int64: "INT64", torch.bool: "BOOL",
                torch.uint8: "UINT8", torch.int8: "INT8"}


def cases():
    """op name -> (input shapes, input dtypes, attrs, which dims are build-time constants per
    input), at small flash-like sizes with a bf16 model."""
    bf, f32, i64, b = torch.bfloat16, torch.float32, torch.int64, torch.bool
    attn_in = [(2, 3, 64, 512), (2, 700, 512), (2, 3, 512), (2, 131, 512), (2, 3, 131), (64,)]
    attn_types = [bf, bf, i64, bf, b, f32]
    attn_const = [(2, 3), (2,), (), (2,), (), (0,)]
    primes = [11, 13, 17, 19, 23, 29]
    return {
        "EngramHashGather": ([(2, 2 + 5), (sum(primes), 256)], [i64, bf],
                             {"multipliers": np.array([3, 5, 7]), "primes": np.array(primes),
                              "offsets": np.cumsum([0] + primes[:-1]), "pad_id": 2, "heads": 3},
                             [(), (1,)]),
        "Csa2IndexScore": ([(2, 3, 32, 128), (2, 3, 32), (2, 700, 128), (2, 3, 700)], [bf, f32, bf, b], {},
                           [(2, 3), (2,), (2,), ()]),
        # kv_qat's FP4 keys: 64 index heads (a power of two >= 16: both tactics)
        "Csa2IndexScoreFp4": ([(2, 3, 64, 128), (2, 3, 64), (2, 700, 64), (2, 700, 4), (2, 3, 700)],
                              [bf, f32, torch.uint8, torch.int8, b], {}, [(2, 3), (2,), (2,), (2,), ()]),
        "Csa2SparseAttention": (attn_in, attn_types, {"scale": 0.04}, attn_const),
        "Csa2SparseAttentionSplit": (attn_in, attn_types,
                                     {"scale": 0.04, "block_keys": 32, "split_target": 66}, attn_const),
        # kv_qat's FP4 entries: 17 selected per row decoded to 512 channels
        "Csa2EntriesFp4": ([(2, 3, 64, 512), (2, 700, 256), (2, 700, 32), (2, 3, 17)],
                           [bf, torch.uint8, torch.uint8, i64], {}, [(2, 3), (2,), (2,), ()]),
        "Csa2AttentionCombine": ([(2, 3, 64, 512), (2, 3, 21, 64, 512), (2, 3, 21, 2, 64), (64,)],
                                 [bf, f32, f32, f32], {}, [(2, 3), (3, 4), (4,), (0,)]),
        "MhcBoundary": ([(2, 3, 4, 5120), (2, 3, 5120), (2, 3, 4), (2, 3, 4, 4), (2, 3, 4), (24, 4 * 5120),
                         (24,), (3,), (5120,)], [bf, bf, f32, f32, f32, f32, f32, f32, bf],
                        {"iters": 20, "hc_eps": 1e-6, "rms_eps": 1e-6},
                        [(2, 3), (2,), (2,), (2, 3), (2,), (0, 1), (0,), (0,), (0,)]),
        # the split form; 6 rows (one row block) aim at 264 splits: 160, one per chunk of 32 channels
        "MhcBoundaryPartials": ([(2, 3, 4, 5120), (2, 3, 5120), (2, 3, 4), (2, 3, 4, 4), (2, 3, 4),
                                 (24, 4 * 5120)],
                                [bf, bf, f32, f32, f32, f32], {"block_e": 32, "split_target": 264},
                                [(2, 3), (2,), (2,), (2, 3), (2,), (0, 1)]),
        "MhcBoundaryFinish": ([(2, 3, 5120), (160, 2, 3, 24), (160, 2, 3, 2), (24,), (3,), (5120,)],
                              [bf, f32, f32, f32, f32, bf], {"iters": 20, "hc_eps": 1e-6, "rms_eps": 1e-6},
                              [(2,), (3,), (3,), (0,), (0,), (0,)]),
    }


def call(fn, descs, attrs, **extra):
    """As tensorrt.plugin calls autotune / aot_impl: the tensors, then only the attributes the
    function names (a subset of the registered ones is allowed), then outputs (and tactic)."""
    names = inspect.signature(fn).parameters
    return fn(*descs, **{k: v for k, v in attrs.items() if k in names}, **extra)


def check() -> None:
    registry = install()
    from dsflash.plugins.declaration import DOMAIN
    from dsflash.plugins.registry import DECLS
    from dsflash.plugins.trt_register import register_trt_plugins

    ids = register_trt_plugins()
    assert sorted(ids) == sorted(f"{DOMAIN}::{d.name}" for d in DECLS), ids
    for decl in DECLS:
        plugin_id = f"{DOMAIN}::{decl.name}"
        shapes, dtypes, attrs, consts = cases()[decl.name]
        descs = [Desc([Expr(n, i in c) for i, n in enumerate(shape)], TORCH_TO_TRT[t])
                 for shape, t, c in zip(shapes, dtypes, consts)]
        outs = registry[("register", plugin_id)](*descs, **attrs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        ref_attrs = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in attrs.items()}
        want = decl.shape_fn(*shapes, **ref_attrs)
        assert [tuple(value(e) for e in o.shape_expr) for o in outs] == [tuple(w) for w in want], decl.name
        model = TORCH_TO_TRT[dtypes[[p.dtype for p in decl.inputs].index("float")]]
        assert [o.dtype for o in outs] == [model if p.dtype == "float" else "FLOAT" for p in decl.outputs], \
            decl.name
        combos = call(registry[("autotune", plugin_id)], descs, attrs, outputs=outs)
        got_types = [TORCH_TO_TRT[t] for t in dtypes] + [o.dtype for o in outs]
        matching = [c for c in combos if all(
            g.replace("FLOAT", "FP32") in types_.split("|") for g, types_ in
            zip(got_types, [x.strip() for x in c[0].split(",")], strict=True))]
        assert matching, f"{decl.name}: no type combination accepts {got_types}: {combos}"
        for tactic in matching[0][2] or [0]:
            name, ptx, launch, extra = call(registry[("aot", plugin_id)], descs, attrs, outputs=outs,
                                            tactic=tactic)
            assert f".entry {name}(" in ptx and launch.block_x > 0, decl.name
            assert all(isinstance(v, int) and v >= 1 for v in map(value, (launch.grid_x, launch.grid_y,
                                                                            launch.grid_z))), decl.name
            assert all(kind == "SymInt32" and isinstance(v, int) for kind, v in extra), (decl.name, extra)
        print(f"{decl.name}: shapes, types and {len(matching[0][2] or [0])} tactic(s) OK")
    check_split_launch(registry)


def check_split_launch(registry) -> None:
    """The split node's symbolic launch (the split plan over shape expressions) against the same
    plan over ints: 3 rows x 2 sequences aim at cdiv(66, 6) = 11 splits of 21 key blocks."""
    from dsflash.plugins.csa2_sparse_attention import trt_split

    shapes, dtypes, attrs, consts = cases()["Csa2SparseAttentionSplit"]
    descs = [Desc([Expr(n, i in c) for i, n in enumerate(shape)], TORCH_TO_TRT[t])
             for shape, t, c in zip(shapes, dtypes, consts)]
    _, _, launch, extra = call(registry[("aot", "trt.plugins::Csa2SparseAttentionSplit")], descs, attrs,
                               outputs=(), tactic=1)
    want = trt_split.aot_launch_split(*shapes[:4], torch.bfloat16, 0.04, 32, 66)
    assert tuple(value(g) for g in (launch.grid_x, launch.grid_y, launch.grid_z)) == want.grid == (6, 4, 11)
    assert tuple(v for _, v in extra) == want.extra == (3, 700, 131, 512, 2), extra
    print("Csa2SparseAttentionSplit: symbolic launch == int launch")
    from dsflash.plugins.mhc_boundary import trt_split as mhc_split

    shapes, dtypes, attrs, consts = cases()["MhcBoundaryPartials"]
    descs = [Desc([Expr(n, i in c) for i, n in enumerate(shape)], TORCH_TO_TRT[t])
             for shape, t, c in zip(shapes, dtypes, consts)]
    for tactic, grid in ((mhc_split.ONE_ROW, (6, 160, 1)), (mhc_split.ROWS_16, (1, 160, 1))):
        _, _, launch, extra = call(registry[("aot", "trt.plugins::MhcBoundaryPartials")], descs, attrs,
                                   outputs=(), tactic=tactic)
        want = mhc_split.aot_launch_partials(shapes[0], shapes[5], torch.bfloat16, 32, 264, tactic)
        assert tuple(value(g) for g in (launch.grid_x, launch.grid_y, launch.grid_z)) == want.grid == grid
        assert tuple(v for _, v in extra) == want.extra == (6, 1, 160), extra
    print("MhcBoundaryPartials: symbolic launch == int launch")


if __name__ == "__main__":
    check()
