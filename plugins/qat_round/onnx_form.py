"""The kv_qat round-trips of model/quant.py written as standard ONNX ops, for their one-node form
while exporting (node.py). fp32 in; every exponent is carried as an exact small integer in fp32
and only a table lookup's index is int64.

The maths is quant.py's export form (its docstring: a log2 guess settled by exact powers, powers
gathered from a table of exact values, round-half-to-even at the value's step), so ONNX Runtime
computes what PyTorch does bit for bit (tests/test_qat_node.py checks every output over the hard
values of tests/test_quant.py). Two steps take a shorter exact form than the traced one:
- exponents stay fp32 (the traced form casts each to int64 and back around its arithmetic);
- an e2m1 grid magnitude's code (0, .5, 1, 1.5 | 2, 3 | 4, 6 -> 0..7) is 2m below 2, m + 2 below
  4, else m / 2 + 4: exact on the grid, where the packs apply it.
Blocks are the last axis cut into `block` channels: [-1, block] rows, reshaped back at the end.
"""

from __future__ import annotations

import math

from onnx import TensorProto

from dsflash.model.quant import (
    E4M3_MANTISSA_BITS,
    E4M3_MAX,
    E4M3_MAX_EXP,
    E4M3_MIN_EXP,
    F32_MAX_EXP,
    F32_MIN_EXP,
)
from dsflash.plugins.dtypes import fp32_pow2


def _op():
    from onnxscript import opset18 as op

    return op


def _const(value: float):
    return _op().Constant(value_float=float(value))


def _clip(x, lo: float, hi: float):
    return _op().Clip(x, _const(lo), _const(hi))


def _as_float(flag):
    return _op().Cast(flag, to=TensorProto.FLOAT)


def pow2(e, lo: int, hi: int):
    """2^e exactly for fp32 integers e (clipped to [lo, hi]): one Gather from the exact powers."""
    op = _op()
    table = op.Constant(value_floats=[fp32_pow2(i) for i in range(lo, hi + 1)])
    index = op.Cast(op.Sub(_clip(e, lo, hi), _const(lo)), to=TensorProto.INT64)
    return op.Gather(table, index, axis=0)


def floor_log2(v, lo: int, hi: int):
    """floor(log2 v) for v >= 0, clipped to [lo, hi] (v = 0 gives lo), as fp32: a guess from Log
    (a runtime's Log may put it one off next to a power of two), then settled."""
    op = _op()
    return settle_log2(v, _clip(op.Floor(op.Mul(op.Log(v), _const(1.0 / math.log(2.0)))), lo, hi), lo, hi)


def settle_log2(v, guess, lo: int, hi: int):
    """floor(log2 v) clipped to [lo, hi] from a guess in [lo, hi] at most one off: one down where
    the guess's exact power exceeds v, one up where twice it does not."""
    op = _op()
    p = pow2(guess, lo, hi)
    down, up = op.Greater(p, v), op.LessOrEqual(op.Mul(p, _const(2.0)), v)
    e = op.Add(op.Sub(guess, _as_float(down)), _as_float(up))
    return _clip(e, lo, hi)


def ceil_log2(v):
    """ceil(log2 v) for fp32-normal v > 0."""
    e = floor_log2(v, F32_MIN_EXP, F32_MAX_EXP)
    return _op().Add(e, _as_float(_op().Less(pow2(e, F32_MIN_EXP, F32_MAX_EXP), v)))


def round_at_step(v, mantissa_bits: int, min_exp: int, max_exp: int):
    """quant.py:_round_at_step: v rounded half-to-even at its step in the float format."""
    op = _op()
    e = op.Sub(floor_log2(op.Abs(v), min_exp, max_exp), _const(mantissa_bits))
    step = pow2(e, min_exp - mantissa_bits, max_exp - mantissa_bits)
    return op.Mul(op.Round(op.Div(v, step)), step)


def round_e4m3(v):
    return round_at_step(_clip(v, -E4M3_MAX, E4M3_MAX), E4M3_MANTISSA_BITS, E4M3_MIN_EXP, E4M3_MAX_EXP)


def round_e2m1(v):
    return round_at_step(v, 1, 0, 2)


def blocks_and_amax(x, block: int):
    """x [..., D] -> (blocks [-1, block], their largest |x| [-1, 1])."""
    op = _op()
    xb = op.Reshape(x, op.Constant(value_ints=[-1, block]))
    return xb, op.ReduceMax(op.Abs(xb), op.Constant(value_ints=[-1]), keepdims=1)


def last_axis_over(x, divisor: int):
    """The shape of x with its last axis divided by `divisor` (int64 [rank])."""
    op = _op()
    last = op.Div(op.Shape(x, start=-1), op.Constant(value_ints=[divisor]))
    return op.Concat(op.Shape(x, end=-1), last, axis=0)


def e2m1_codes(v, x):
    """e2m1 grid values (any shape) -> the packed codes [..., D / 2] uint8 of x's shape: bit 3 the
    sign (a zero packs as +0), bits 0-2 the grid index; the even channel in the low nibble."""
    op = _op()
    mag = op.Abs(v)
    index = op.Where(op.Less(mag, _const(2.0)), op.Mul(mag, _const(2.0)),
                     op.Where(op.Less(mag, _const(4.0)), op.Add(mag, _const(2.0)),
                              op.Add(op.Mul(mag, _const(0.5)), _const(4.0))))
    code = op.Add(index, op.Mul(_as_float(op.Less(v, _const(0.0))), _const(8.0)))
    low, high = op.Split(op.Reshape(code, op.Constant(value_ints=[-1, 2])), axis=1, num_outputs=2)
    byte = op.Cast(op.Add(low, op.Mul(high, _const(16.0))), to=TensorProto.UINT8)
    return op.Reshape(byte, last_axis_over(x, 2))


def e4m3_bits(s):
    """quant.py:e4m3_code: e4m3 values s in [0, 448] -> their float8_e4m3fn bits, fp32."""
    op = _op()
    e = floor_log2(s, E4M3_MIN_EXP, E4M3_MAX_EXP)
    normal = op.GreaterOrEqual(s, _const(2.0**E4M3_MIN_EXP))
    scaled = op.Mul(op.Div(s, pow2(e, E4M3_MIN_EXP, E4M3_MAX_EXP)), _const(8.0))
    mant = op.Where(normal, op.Sub(scaled, _const(8.0)), op.Mul(s, _const(2.0**9)))
    return op.Add(op.Where(normal, op.Mul(op.Add(e, _const(7.0)), _const(8.0)), _const(0.0)), mant)


def fp8_e4m3_qat_onnx(x):
    """quant.py:fp8_e4m3_qat on fp32 x (block 32)."""
    op = _op()
    xb, amax = blocks_and_amax(x, 32)
    wanted = op.Mul(op.Max(amax, _const(1e-4)), _const(1.0 / E4M3_MAX))
    s = pow2(ceil_log2(wanted), F32_MIN_EXP, F32_MAX_EXP + 1)
    return op.Reshape(op.Mul(round_e4m3(op.Div(xb, s)), s), op.Shape(x))


def _fp4_pow2(x):
    """quant.py:_fp4_pow2 (block 32): (grid values [-1, 32], scales [-1, 1], exponents [-1, 1])."""
    op = _op()
    xb, amax = blocks_and_amax(x, 32)
    e = ceil_log2(op.Div(op.Max(amax, _const(6 * 2.0**F32_MIN_EXP)), _const(6.0)))
    s = pow2(e, F32_MIN_EXP, F32_MAX_EXP + 1)
    return round_e2m1(_clip(op.Div(xb, s), -6.0, 6.0)), s, e


def fp4_pow2_qat_onnx(x):
    """quant.py:fp4_pow2_qat on fp32 x (block 32)."""
    op = _op()
    v, s, _ = _fp4_pow2(x)
    return op.Reshape(op.Mul(v, s), op.Shape(x))


def fp4_pow2_pack_onnx(x):
    """quant.py:fp4_pow2_pack on fp32 x: (codes [..., D/2] uint8, exponents [..., D/32] int8)."""
    op = _op()
    v, _, e = _fp4_pow2(x)
    exps = op.Reshape(op.Cast(e, to=TensorProto.INT8), last_axis_over(x, 32))
    return e2m1_codes(v, x), exps


def fp4_e4m3scale_pack_onnx(x):
    """quant.py:fp4_e4m3scale_pack on fp32 x (block 16): (codes [..., D/2] uint8, e4m3 scale bits
    [..., D/16] uint8)."""
    op = _op()
    xb, amax = blocks_and_amax(x, 16)
    s = round_e4m3(op.Div(op.Max(amax, _const(6 * 2.0**-9)), _const(6.0)))
    v = round_e2m1(_clip(op.Div(xb, s), -6.0, 6.0))
    scales = op.Reshape(op.Cast(e4m3_bits(s), to=TensorProto.UINT8), last_axis_over(x, 16))
    return e2m1_codes(v, x), scales
