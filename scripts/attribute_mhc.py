#!/usr/bin/env python3
"""Where MhcBoundary's prefill time goes: the same kernel with one part taken out at a time,
timed against the unchanged kernel in the same run (H200 sessions: a timing says how slow, this
says which part; ncu says why).

    python3 scripts/attribute_mhc.py [--tokens 8192] [--out DIR]

Each variant is kernel.py with source edits (every edit must apply, or the script stops), loaded
as its own module. A variant that drops work computes a wrong result by construction: nothing is
checked here except that the unchanged copy matches the installed kernel bit for bit. The copy
bound is torch's device copy of the same bytes (streams -> new, y -> x): what the traffic alone
costs at this access pattern.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import tempfile
from pathlib import Path

import bench_kernels as bench
import torch

from dsflash.plugins.mhc_boundary import kernel as mhc_kernel

_DOT = 'acc += tl.dot(nf, tl.trans(fn_k), input_precision="tf32")'
_NORM = "_normalise_rows(sumsq_x, t64, tmask, x_ptr, nw_ptr, E, RMS_EPS, NORM_E)"
_NEW_STORE = "tl.store(new_ptr + (t64[:, None] * C + k) * E + e[None, :], new_k, mask=m2)"
_STREAM_LOAD = "tl.load(streams_ptr + (t64[:, None] * C + j) * E + e[None, :], mask=m2, other=0.0)"
_Y_LOAD = "tl.load(y_ptr + t64[:, None] * E + e[None, :], mask=m2, other=0.0)"
_X_STORE = "tl.store(x_ptr + t64[:, None] * E + e[None, :], x, mask=m2)"

_NF = "nf = new_k.to(tl.float32)"
# a non-pure identity: Triton may not duplicate it, so R' is computed once and converted to the
# dot's operand layout through shared memory instead of recomputed in that layout
_NF_ONCE = ('nf = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [new_k.to(tl.float32)], '
            'dtype=tl.float32, is_pure=False, pack=1)')
_NF_ONCE_BF16 = ('nf = tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [new_k], '
                 'dtype=new_k.dtype, is_pure=False, pack=1).to(tl.float32)')
_NORM_LOOP = "for e0 in tl.range(0, E, NORM_E, num_stages=3):"
_EVICT = [(_STREAM_LOAD, _STREAM_LOAD[:-1] + ', eviction_policy="evict_first")', 1),
          (_Y_LOAD, _Y_LOAD[:-1] + ', eviction_policy="evict_first")', 1),
          (_NEW_STORE, _NEW_STORE[:-1] + ', eviction_policy="evict_first")', 1)]
_HI_LO = ("fh = fn_k.to(tl.bfloat16); acc += tl.dot(new_k, tl.trans(fh)); "
          "acc += tl.dot(new_k, tl.trans((fn_k - fh.to(tl.float32)).to(tl.bfloat16)))")


def _cfg(bt, be, warps=4, stages=4, **extra) -> dict:
    return dict(BLOCK_T=bt, BLOCK_E=be, num_warps=warps, num_stages=stages, **extra)


# name -> (source edits [(old, new, count)], launch overrides, channel splits (None: the default))
VARIANTS = {
    "unchanged copy": ([], {}, None),
    "no projection (dot and fn loads)": ([(_DOT, "acc += 0.0", 1)], {}, None),
    "no RMSNorm pass over x": ([(_NORM, "pass", 2)], {}, None),
    "no new-stream stores": ([(_NEW_STORE, "pass", 1)], {}, None),
    "RMSNorm loop not pipelined": ([(_NORM_LOOP, "for e0 in range(0, E, NORM_E):", 1)], {}, None),
    "RMSNorm tiles of 8K values": ([], {"NORM_E": 128}, None),
    "RMSNorm tiles of 16K values": ([], {"NORM_E": 256}, None),
    "streams, y, new evict_first": (_EVICT, {}, None),
    "same + x stored evict_last": (_EVICT + [(_X_STORE, _X_STORE[:-1] + ', eviction_policy="evict_last")', 1)],
                                   {}, None),
    "projection as two bf16 dots (fn hi + lo)": ([(_DOT, _HI_LO, 1)], {}, None),
    "R' once (asm fence)": ([(_NF, _NF_ONCE, 1)], {}, None),
    "R' once, 3 splits": ([(_NF, _NF_ONCE, 1)], {}, 3),
    "R' once, 4 splits": ([(_NF, _NF_ONCE, 1)], {}, 4),
    "R' once, 64 x 32": ([(_NF, _NF_ONCE, 1)], _cfg(64, 32), None),
    "R' once, 32 x 32 whole rows": ([(_NF, _NF_ONCE, 1)], _cfg(32, 32), 1),
    "R' once, 32 x 32 whole rows, 3 stages": ([(_NF, _NF_ONCE, 1)], _cfg(32, 32, stages=3), 1),
    "R' once, 64 x 16 whole rows": ([(_NF, _NF_ONCE, 1)], _cfg(64, 16), 1),
    "R' once, 16 x 32 whole rows": ([(_NF, _NF_ONCE, 1)], _cfg(16, 32), 1),
    "R' once + evict_first": ([(_NF, _NF_ONCE, 1)] + _EVICT, {}, None),
    "R' once, fenced in bf16": ([(_NF, _NF_ONCE_BF16, 1)], {}, None),
    "R' once, RMSNorm tiles of 8K values": ([(_NF, _NF_ONCE, 1)], {"NORM_E": 128}, None),
    "R' once, 3 splits, RMSNorm tiles of 8K values": ([(_NF, _NF_ONCE, 1)], {"NORM_E": 128}, 3),
    "unchanged, 3 splits": ([], {}, 3),
    "unchanged, 168 registers (3 programs per SM), 3 splits": ([], {"maxnreg": 168}, 3),
    "unchanged, 32 x 32 whole rows": ([], _cfg(32, 32), 1),
}


def load_variant(name: str, edits: list, folder: Path):
    src = Path(mhc_kernel.__file__).read_text()
    for old, new, count in edits:
        found = src.count(old)
        if found != count:
            raise SystemExit(f"variant {name!r}: {old!r} occurs {found} times in kernel.py, expected {count}")
        src = src.replace(old, new)
    path = folder / f"mhc_variant_{len(list(folder.iterdir()))}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    gen = torch.Generator().manual_seed(0)
    inputs = [a.cuda() for a in bench.mhc_inputs(args.tokens, gen)] + [20, 1e-6, 1e-6]
    want = mhc_kernel.MhcBoundaryLauncher()(*inputs)
    res = {"installed kernel": 1e3 * bench.time_ms(lambda: mhc_kernel.MhcBoundaryLauncher()(*inputs))}
    streams, y = inputs[0], inputs[1]
    new, x = torch.empty_like(streams), torch.empty_like(y)
    res["copy bound (streams -> new, y -> x)"] = 1e3 * bench.time_ms(lambda: (new.copy_(streams), x.copy_(y)))
    with tempfile.TemporaryDirectory() as tmp:
        for name, (edits, overrides, n_split) in VARIANTS.items():
            module = load_variant(name, edits, Path(tmp))
            launcher = module.MhcBoundaryLauncher(overrides=overrides)
            try:
                got = launcher(*inputs, n_split=n_split)
            except Exception as err:  # noqa: BLE001 (a variant that fails to compile: say so, time the rest)
                logging.warning("%s: %s", name, str(err).splitlines()[:3])
                continue
            if name == "unchanged copy" and not all(torch.equal(g, w) for g, w in zip(got, want)):
                raise SystemExit("the unchanged copy differs from the installed kernel")
            same = bench._close(got, want, 2e-2)  # False for the variants that drop work
            res[name] = 1e3 * bench.time_ms(lambda f=launcher, n=n_split: f(*inputs, n_split=n))
            logging.info("%-60s %8.1f us%s", name, res[name], "" if same else "  (result differs)")
    for name, us in res.items():
        logging.info("%-60s %8.1f us  (%.2fx the installed kernel)", name, us, us / res["installed kernel"])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"attribute_mhc_{args.tokens}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
