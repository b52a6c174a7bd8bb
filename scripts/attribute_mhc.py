#!/usr/bin/env python3
"""Where MhcBoundary's prefill time goes: the same kernel with one part taken out at a time,
timed against the unchanged kernel in the same run (H200 sessions: a timing says how slow, this
says which part; ncu says why).

    python3 scripts/attribute_mhc.py [--tokens 8192] [--out DIR]

Each variant is kernel.py and finish.py with source edits (every edit must apply, or the script
stops), loaded as modules of their own. A variant that drops work computes a wrong result by
construction: nothing is checked here except that the unchanged copy matches the installed kernel
bit for bit. The copy bound is torch's device copy of the same bytes (streams -> new, y -> x):
what the traffic alone costs at this access pattern.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

from dsflash.plugins.mhc_boundary import finish as mhc_finish
from dsflash.plugins.mhc_boundary import kernel as mhc_kernel

log = logging.getLogger("attribute_mhc")

_DOT = 'acc += tl.dot(nf, tl.trans(fn_k), input_precision="tf32")'
_NORM = "normalise_rows(sumsq_x, t64, tmask, x_ptr, nw_ptr, E, RMS_EPS, NORM_E)"
_NEW_STORE = "tl.store(new_ptr + (t64[:, None] * C + k) * E + e[None, :], new_k, mask=m2)"
_STREAM_LOAD = "tl.load(streams_ptr + (t64[:, None] * C + j) * E + e[None, :], mask=m2, other=0.0)"
_Y_LOAD = "tl.load(y_ptr + t64[:, None] * E + e[None, :], mask=m2, other=0.0)"
_X_STORE = "tl.store(x_ptr + t64[:, None] * E + e[None, :], x, mask=m2)"

_NORM_LOOP = "for e0 in tl.range(0, E, NORM_E, num_stages=3):"
_EVICT = [(_STREAM_LOAD, _STREAM_LOAD[:-1] + ', eviction_policy="evict_first")', 1),
          (_Y_LOAD, _Y_LOAD[:-1] + ', eviction_policy="evict_first")', 1),
          (_NEW_STORE, _NEW_STORE[:-1] + ', eviction_policy="evict_first")', 1)]
_HI_LO = ("fh = fn_k.to(tl.bfloat16); acc += tl.dot(new_k, tl.trans(fh)); "
          "acc += tl.dot(new_k, tl.trans((fn_k - fh.to(tl.float32)).to(tl.bfloat16)))")


def _cfg(bt, be, stages, norm_e, warps=4, **extra) -> dict:
    return dict(BLOCK_T=bt, BLOCK_E=be, num_stages=stages, NORM_E=norm_e, num_warps=warps, **extra)


# name -> (source edits [(old, new, count)], launch overrides, channel splits (None: the default)).
# Session 8's first run (docs/attribute_mhc_h200_2026-12-03a.json) took parts out of the kernel
# of that time and tried eviction hints, bf16 dots and R' computed once; the second
# (docs/attribute_mhc_h200_2026-12-03b.json) ran this list up to the 32 x 32 splits.
VARIANTS = {
    "unchanged copy": ([], {}, None),
    "no projection (dot and fn loads)": ([(_DOT, "acc += 0.0", 1)], {}, None),
    "no RMSNorm pass over x": ([(_NORM, "pass", 2)], {}, None),
    "no new-stream stores": ([(_NEW_STORE, "pass", 1)], {}, None),
    # decode sizes (session 13): the split blocks' finish
    "Sinkhorn: 1 iteration": ([("for _ in range(ITERS - 1):", "for _ in range(0):", 2)], {}, None),
    "barrier at every block size": ([], {"BARRIER": True}, None),
    "no barrier (the last program normalises the block)": ([], {"BARRIER": False}, None),
    "R' twice (no fence)": ([], {"ONCE": False}, None),
    "RMSNorm loop 4 stages": ([(_NORM_LOOP, _NORM_LOOP.replace("=3", "=4"), 1)], {}, None),
    "streams, y, new evict_first": (_EVICT, {}, None),
    "projection as two bf16 dots (fn hi + lo)": ([(_DOT, _HI_LO, 1)], {}, None),
    "64 x 32, 3 stages, RMSNorm 16K": ([], _cfg(64, 32, 3, 256), None),
    "64 x 16, 4 stages, RMSNorm 16K": ([], _cfg(64, 16, 4, 256), None),
    "64 x 16, 4 stages, RMSNorm 16K, 3 splits": ([], _cfg(64, 16, 4, 256), 3),
    "64 x 32, 4 stages, RMSNorm 16K, whole rows": ([], _cfg(64, 32, 4, 256), 1),
    "64 x 32, 3 stages, RMSNorm 16K, whole rows": ([], _cfg(64, 32, 3, 256), 1),
    "32 x 32, 4 stages, RMSNorm 16K, whole rows (TensorRT)": ([], _cfg(32, 32, 4, 512), 1),
    "32 x 32, 3 stages, RMSNorm 16K, whole rows": ([], _cfg(32, 32, 3, 512), 1),
    "32 x 32, 4 stages, RMSNorm 8K, whole rows": ([], _cfg(32, 32, 4, 256), 1),
    "32 x 32, 4 stages, RMSNorm 16K, 2 splits": ([], _cfg(32, 32, 4, 512), 2),
    "64 x 32, 5 stages, RMSNorm 16K, whole rows": ([], _cfg(64, 32, 5, 256), 1),
    "64 x 32, 4 stages, 8 warps, RMSNorm 16K, whole rows": ([], _cfg(64, 32, 4, 256, warps=8), 1),
    "64 x 32, 4 stages, RMSNorm 16K, 2 splits": ([], _cfg(64, 32, 4, 256), 2),
}


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # kernel.py's variant imports its finish.py variant by name
    spec.loader.exec_module(module)
    return module


def load_variant(name: str, edits: list, folder: Path):
    """kernel.py and finish.py with the edits applied (each edit in whichever file holds it; the
    counts are over both), loaded as modules of their own: the kernel variant imports the finish
    variant. Returns the kernel module; `variant_sources` lists both files."""
    sources = {"kernel.py": Path(mhc_kernel.__file__).read_text(),
               "finish.py": Path(mhc_finish.__file__).read_text()}
    for old, new, count in edits:
        found = sum(src.count(old) for src in sources.values())
        if found != count:
            raise SystemExit(f"variant {name!r}: {old!r} occurs {found} times in kernel.py and finish.py, "
                             f"expected {count}")
        sources = {f: src.replace(old, new) for f, src in sources.items()}
    n = len(list(folder.iterdir())) // 2
    finish_path, kernel_path = folder / f"mhc_finish_variant_{n}.py", folder / f"mhc_variant_{n}.py"
    finish_path.write_text(sources["finish.py"])
    kernel_src = sources["kernel.py"].replace("from dsflash.plugins.mhc_boundary.finish import",
                                              f"from {finish_path.stem} import")
    kernel_path.write_text(kernel_src)
    _load(finish_path)
    module = _load(kernel_path)
    module.variant_sources = [kernel_path, finish_path]
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", nargs="*", default=[],
                    help="run only the variants whose names contain one of these")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import bench_kernels as bench  # here: the variant table and load_variant are tested on the CPU

    gen = torch.Generator().manual_seed(0)
    inputs = [a.cuda() for a in bench.mhc_inputs(args.tokens, gen)] + [20, 1e-6, 1e-6]
    want = mhc_kernel.MhcBoundaryLauncher()(*inputs)
    res = {"installed kernel": 1e3 * bench.time_ms(lambda: mhc_kernel.MhcBoundaryLauncher()(*inputs))}
    streams, y = inputs[0], inputs[1]
    new, x = torch.empty_like(streams), torch.empty_like(y)
    res["copy bound (streams -> new, y -> x)"] = 1e3 * bench.time_ms(lambda: (new.copy_(streams), x.copy_(y)))
    with tempfile.TemporaryDirectory() as tmp:
        for name, (edits, overrides, n_split) in VARIANTS.items():
            if args.only and not any(part in name for part in args.only):
                continue
            module = load_variant(name, edits, Path(tmp))
            launcher = module.MhcBoundaryLauncher(overrides=overrides)
            try:
                got = launcher(*inputs, n_split=n_split)
            except Exception as err:  # noqa: BLE001 (a variant that fails to compile: say so, time the rest)
                log.warning("%s: %s", name, str(err).splitlines()[:3])
                continue
            if name == "unchanged copy" and not all(torch.equal(g, w) for g, w in zip(got, want)):
                raise SystemExit("the unchanged copy differs from the installed kernel")
            same = bench._close(got, want, 2e-2)  # False for the variants that drop work
            res[name] = 1e3 * bench.time_ms(lambda f=launcher, n=n_split: f(*inputs, n_split=n))
            log.info("%-60s %8.1f us%s", name, res[name], "" if same else "  (result differs)")
    for name, us in res.items():
        log.info("%-60s %8.1f us  (%.2fx the installed kernel)", name, us, us / res["installed kernel"])
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"attribute_mhc_{args.tokens}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
