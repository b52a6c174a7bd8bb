"""Rounding flips in the graph checks of kv_qat models (export/accuracy.py).

A kv_qat model rounds its window KV to FP8 and its compressed entries and index keys to FP4
(model/quant.py). ONNX Runtime computes the values before rounding in another order than
PyTorch, so a value within an ulp or so of a rounding boundary lands on the other grid point:
one element one grid step away (seen: 0.96874994 in PyTorch, a tie at 0.96875 in ONNX Runtime,
1.0 against 0.9375). Everything computed from it after that differs by more than the MODEL
tolerance, although both sides are right; no tolerance can cover a jump of one grid step.

A failing step of a kv_qat check therefore counts as a flip, not a failure, when the first layer
whose quantised rows differ (new_swa_rows, new_kv.<src>, new_index_k.<src>) differs only by
elements one grid step apart, and the step's greedy token (argmax of the logits) is the
reference's. The check still fails when flips are not rare (accuracy.py: at most one step in
four) and on any step that differs without one.
"""

from __future__ import annotations

import numpy as np

from dsflash.model.quant import E4M3_MANTISSA_BITS

WINDOW_ROWS = "new_swa_rows"          # [layers, B, S, Dh], FP8 e4m3 values under kv_qat
ENTRY_OUTPUTS = ("new_kv.", "new_index_k.")  # [B, S, D] of source layer <src>, FP4 e2m1 values


def mismatch(got: np.ndarray, want: np.ndarray, tol: dict) -> np.ndarray:
    """Polygraphy's elementwise rule: an element matches within atol or within rtol."""
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    return (diff > tol["atol"]) & (diff > tol["rtol"] * np.abs(want.astype(np.float64)))


def one_step_apart(got: np.ndarray, want: np.ndarray, mantissa_bits: int | None) -> np.ndarray:
    """Elements that are neighbours on their grid: same sign (or a zero), and apart by at most one
    step at the larger magnitude: 2^(floor(log2 m) - mantissa bits) for FP8; an e2m1 step, or a
    step from zero (whose size depends on the block's scale, not known here), is at most the
    larger magnitude itself (0 -> 0.5 at the bottom of the e2m1 grid)."""
    g, w = got.astype(np.float64), want.astype(np.float64)
    larger = np.maximum(np.abs(g), np.abs(w))
    same_side = (g * w >= 0)
    step = larger
    if mantissa_bits is not None:
        normal = np.exp2(np.floor(np.log2(np.where(larger > 0, larger, 1.0))) - mantissa_bits)
        step = np.where((g == 0) | (w == 0), larger, normal)
    return same_side & (np.abs(g - w) <= step)


def _differing_layers(got: dict, want: dict, tol: dict, first_layer: int) -> dict[int, list]:
    """layer -> [(grid mantissa bits, got, want) of its differing quantised elements]."""
    layers: dict[int, list] = {}
    if WINDOW_ROWS in want:
        bad = mismatch(got[WINDOW_ROWS], want[WINDOW_ROWS], tol)
        for layer in np.unique(np.nonzero(bad)[0]):
            sel = bad[layer]
            layers.setdefault(first_layer + int(layer), []).append(
                (E4M3_MANTISSA_BITS, got[WINDOW_ROWS][layer][sel], want[WINDOW_ROWS][layer][sel]))
    for name in want:
        if name.startswith(ENTRY_OUTPUTS):
            g, w = _entry_values(got, name), _entry_values(want, name)
            bad = mismatch(g, w, tol)
            if bad.any():
                layers.setdefault(int(name.split(".")[-1]), []).append((None, g[bad], w[bad]))
    return layers


def _entry_values(outputs: dict, name: str) -> np.ndarray:
    """An entry output's values: kv_qat's entries and index keys come packed (new_kv codes with
    the new_kv_scale e4m3 scale bits, new_index_k codes with the new_index_e exponents,
    model/cache.py), compared as the FP4 values they stand for, so a differing code byte, scale or
    exponent counts as what it changes."""
    value = outputs[name]
    if value.dtype != np.uint8:
        return value
    import torch

    from dsflash.plugins.csa2_index_score.reference import unpack_keys_fp4
    from dsflash.plugins.csa2_sparse_attention.reference import unpack_entries_fp4

    if name.startswith("new_kv."):
        unpack, side = unpack_entries_fp4, outputs[name.replace("new_kv.", "new_kv_scale.")]
    else:
        unpack, side = unpack_keys_fp4, outputs[name.replace("new_index_k.", "new_index_e.")]
    return unpack(torch.from_numpy(value), torch.from_numpy(side), torch.float32).numpy()


def explain_flip(got: dict, want: dict, tol: dict, first_layer: int = 0) -> str | None:
    """Why a failing step of a kv_qat graph is a rounding flip, or None when it is not one."""
    layers = _differing_layers(got, want, tol, first_layer)
    if not layers:
        return None
    origin = min(layers)
    for bits, g, w in layers[origin]:
        if not one_step_apart(g, w, bits).all():
            return None
    if "logits" in want and not np.array_equal(got["logits"].argmax(-1), want["logits"].argmax(-1)):
        return None
    count = sum(g.size for _, g, _ in layers[origin])
    return f"rounding flip at layer {origin}: {count} element(s) one grid step apart"
