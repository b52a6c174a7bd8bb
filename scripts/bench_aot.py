#!/usr/bin/env python3
"""What a TensorRT engine's plugin kernels would cost, measured without TensorRT: each plugin's AOT
kernel (the PTX and launch its trt.py hands TensorRT, run by plugins/ptx_launch.py as TensorRT
runs it) against the JIT launcher OpSet("triton") uses, at the released sizes, as CUDA-graph
replays back to back (the launch floor of scripts/bench_floor.py applies to both). Each AOT
variant is checked against the JIT output first and reported WRONG instead of timed if it
differs. Variants: every tactic, pointers taken as 16-byte aligned (the build's default) or not;
for the attention and the mHC boundary also decoder_step's split forms (two kernels each, timed
together).

    python3 scripts/bench_aot.py --out OUT [--sweep | --sweep-only]   # H200: ~1.5 min, the sweep ~2.5
    python3 scripts/bench_aot.py --out OUT --only attention --split-attrs 64:66,64:132   # split attributes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
from bench_kernels import (
    BF16,
    ENGRAM_DIM,
    ENGRAM_HEADS,
    ENGRAM_LOOK,
    HEAD_DIM,
    HEADS,
    INDEX_DIM,
    INDEX_HEADS,
    TOPK,
    WINDOW,
    _close,
    mhc_inputs,
    time_ms,
)
from tqdm import tqdm

from dsflash.plugins.aot import AotLaunch
from dsflash.plugins.csa2_index_score import kernel as index_kernel
from dsflash.plugins.csa2_index_score import trt as index_trt
from dsflash.plugins.csa2_sparse_attention import kernel as attn_kernel
from dsflash.plugins.csa2_sparse_attention import splits as attn_splits
from dsflash.plugins.csa2_sparse_attention import trt as attn_trt
from dsflash.plugins.csa2_sparse_attention import trt_split as attn_split_trt
from dsflash.plugins.engram_hash_gather import kernel as engram_kernel
from dsflash.plugins.engram_hash_gather import trt as engram_trt
from dsflash.plugins.mhc_boundary import kernel as mhc_kernel
from dsflash.plugins.mhc_boundary import split_form as mhc_split_jit
from dsflash.plugins.mhc_boundary import splits as mhc_splits
from dsflash.plugins.mhc_boundary import trt as mhc_trt
from dsflash.plugins.mhc_boundary import trt_split as mhc_split_trt
from dsflash.plugins.ptx_launch import PtxKernel

log = logging.getLogger("bench_aot")


def single_runner(stack: contextlib.ExitStack, launch: AotLaunch, inputs: list, outs: list):
    kernel = stack.enter_context(PtxKernel(launch))
    return lambda: kernel(launch, inputs, outs)


@dataclass(frozen=True)
class SplitForm:
    """decoder_step's two attention nodes: the split kernel writes the partials, the combine kernel
    (inputs q, acc, ml, sink) merges them; timed together."""
    split: AotLaunch
    combine: AotLaunch
    acc_shape: tuple
    ml_shape: tuple

    @property
    def kernel(self):  # the first node's, for the shared-memory column
        return self.split.kernel

    def runner(self, stack: contextlib.ExitStack, inputs: list, outs: list):
        first, second = (stack.enter_context(PtxKernel(x)) for x in (self.split, self.combine))
        acc = torch.empty(self.acc_shape, dtype=torch.float32, device="cuda")
        ml = torch.empty(self.ml_shape, dtype=torch.float32, device="cuda")

        def run():
            first(self.split, inputs, [acc, ml])
            second(self.combine, [inputs[0], acc, ml, inputs[5]], outs)
        return run


@dataclass(frozen=True)
class MhcSplitForm:
    """decoder_step's two mHC nodes: the partials kernel writes the new streams, x unnormalised and
    the partial sums; the finish kernel (inputs x_raw, mixes, sums, base, scale, norm_weight)
    writes x and the next coefficients; timed together."""
    partials: AotLaunch
    finish: AotLaunch
    shapes: list  # new, x_raw, mixes, sums

    @property
    def kernel(self):
        return self.partials.kernel

    def runner(self, stack: contextlib.ExitStack, inputs: list, outs: list):
        first, second = (stack.enter_context(PtxKernel(x)) for x in (self.partials, self.finish))
        x_raw = torch.empty(self.shapes[1], dtype=BF16, device="cuda")
        mixes, sums = (torch.empty(shape, dtype=torch.float32, device="cuda") for shape in self.shapes[2:])

        def run():
            first(self.partials, inputs[:6], [outs[0], x_raw, mixes, sums])
            second(self.finish, [x_raw, mixes, sums, *inputs[6:]], outs[1:])
        return run


def mhc_split_form(streams_shape, fn_shape, attrs: tuple, partials_tactic: int,
                   finish_tactic: int) -> MhcSplitForm:
    split = mhc_splits.export_attrs(streams_shape[3])
    _, _, shapes = mhc_split_trt.partials_outputs(streams_shape, fn_shape, **split)
    partials = mhc_split_trt.aot_launch_partials(streams_shape, fn_shape, BF16, **split,
                                                 tactic=partials_tactic)
    finish = mhc_split_trt.aot_launch_finish(shapes[1], shapes[2], BF16, *attrs, tactic=finish_tactic)
    return MhcSplitForm(partials, finish, shapes)


def split_form(q, kv, idx, win, scale: float, tactic: int, combine_tactic: int,
               attrs: dict | None = None) -> SplitForm:
    """The two nodes with the export's split attributes, or `attrs` (block_keys, split_target)."""
    attrs = attrs or attn_splits.export_attrs(q.shape[2], q.shape[3])
    _, acc_shape, ml_shape = attn_split_trt.split_outputs(q.shape, idx.shape, win.shape, **attrs)
    split = attn_split_trt.aot_launch_split(q.shape, kv.shape, idx.shape, win.shape, BF16, scale, **attrs,
                                            tactic=tactic)
    combine = attn_split_trt.aot_launch_combine(q.shape, acc_shape, BF16, tactic=combine_tactic)
    return SplitForm(split, combine, acc_shape, ml_shape)


def compare(case: str, jit, variants: dict, inputs: list, outputs, rel: float) -> dict:
    """JIT launcher time and each AOT variant's (label -> AotLaunch), in microseconds."""
    want = jit()
    want = want if isinstance(want, (tuple, list)) else (want,)
    res = {"jit_us": 1e3 * time_ms(jit, graph=True)}
    for label, launch in variants.items():
        res[f"{label}_us"] = float("nan")
        if isinstance(launch, Exception):
            log.info("%s %s: does not compile: %s", case, label, str(launch).splitlines()[0][:100])
            continue
        outs = outputs()
        with contextlib.ExitStack() as stack:
            try:
                run = (launch.runner(stack, inputs, outs) if isinstance(launch, (SplitForm, MhcSplitForm))
                       else single_runner(stack, launch, inputs, outs))
            except (ValueError, RuntimeError) as exc:  # more shared memory than a block gets, say
                log.info("%s %s: does not load: %s", case, label, exc)
                continue
            run()
            torch.cuda.synchronize()
            if not _close(outs, want, rel):
                log.warning("%s %s: WRONG result, not timed", case, label)
                continue
            res[f"{label}_us"] = 1e3 * time_ms(run, graph=True)
        res[f"{label}_shared"] = launch.kernel.shared_mem
        log.info("%s %s: %.1f us (JIT %.1f us)", case, label, res[f"{label}_us"], res["jit_us"])
    return res


def compiled(settings: dict, make) -> dict:
    """label -> make(*setting), or the exception a setting's compile raised (reported, not timed)."""
    out = {}
    for label, setting in settings.items():
        try:
            out[label] = make(*setting)
        except Exception as exc:  # noqa: BLE001 (a sweep setting that does not compile is a result)
            out[label] = exc
    return out


def index_case(n: int, gen) -> dict:
    q = torch.randn(1, 1, INDEX_HEADS, INDEX_DIM, generator=gen).to("cuda", BF16)
    w = torch.randn(1, 1, INDEX_HEADS, generator=gen).cuda()
    k = torch.randn(1, n, INDEX_DIM, generator=gen).to("cuda", BF16)
    visible = torch.ones(1, 1, n, dtype=torch.bool, device="cuda")
    variants = {f"tactic{t}{'' if aligned else '_unaligned'}":
                index_trt.aot_launch(q.shape, k.shape, BF16, t, aligned)
                for t in index_trt.tactics(BF16, INDEX_DIM) for aligned in (True, False)}
    return compare(f"index n={n}", lambda: index_kernel.csa2_index_score(q, w, k, visible), variants,
                   [q, w, k, visible], lambda: [torch.empty(1, 1, n, device="cuda")], 1e-5)


def attention_case(rows: int, gen, settings: dict | None = None, split_attrs: tuple = (),
                   decode: bool = False) -> dict:
    """settings: label -> (aligned, launch_config overrides); by default the plugin's tactics, and the
    first compiled for any pointer alignment. split_attrs: (block_keys, split_target) pairs to time
    the split form under besides the export's, every tactic those allow. decode: decoder_step's
    shapes, `rows` sequences of one row each, every one over its own 64K entries and window
    (made on the GPU: 8.6 GB of entries at 128 rows); else one sequence of `rows` rows."""
    n = 65536
    b, s = (rows, 1) if decode else (1, rows)
    cuda_gen = torch.Generator("cuda").manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    q = torch.randn(b, s, HEADS, HEAD_DIM, generator=gen).to("cuda", BF16)
    kv = torch.randn(b, n, HEAD_DIM, generator=cuda_gen, device="cuda").to(BF16)
    idx = torch.randint(0, n, (b, s, TOPK), generator=gen).cuda()
    win = torch.randn(b, WINDOW + s, HEAD_DIM, generator=gen).to("cuda", BF16)
    wmask = torch.ones(b, s, WINDOW + s, dtype=torch.bool, device="cuda")
    sink = torch.randn(HEADS, generator=gen).cuda()
    scale = HEAD_DIM ** -0.5
    launcher = attn_kernel.SparseAttentionLauncher()
    default = {f"tactic{t}": (True, attn_trt.tactic_overrides(t, BF16, HEADS, HEAD_DIM))
               for t in attn_trt.tactics(BF16, HEADS, HEAD_DIM)} | {"tactic1_unaligned": (False, {})}
    settings = settings or default
    variants = compiled(settings, lambda aligned, over: attn_trt.aot_launch(
        q.shape, kv.shape, idx.shape, win.shape, BF16, scale, aligned=aligned, overrides=over))
    # decoder_step's split form: every split tactic (3: the Gluon kernel) with each combine tactic
    export = attn_splits.export_attrs(HEADS, HEAD_DIM)
    for attrs in ([export] if settings is default else []) + [
            {"block_keys": keys, "split_target": target} for keys, target in split_attrs]:
        name = "split_form" if attrs is export else f"split_k{attrs['block_keys']}_t{attrs['split_target']}"
        variants |= compiled({f"{name}_tactic{t}_combine{c}": (t, c)
                              for t in attn_split_trt.tactics(BF16, HEADS, HEAD_DIM, attrs["block_keys"])
                              for c in attn_split_trt.combine_tactics()},
                             lambda t, c, attrs=attrs: split_form(q, kv, idx, win, scale, t, c, attrs))
    name = f"attention batch={rows}" if decode else f"attention rows={rows}"
    return compare(name, lambda: launcher(q, kv, idx, win, wmask, sink, scale), variants,
                   [q, kv, idx, win, wmask, sink], lambda: [torch.empty_like(q)], 1e-2)


def engram_case(batch: int, new: int, gen) -> dict:
    cols = ENGRAM_LOOK * ENGRAM_HEADS
    primes = [(1 << 18) + 2 * i for i in range(cols)]  # 6.3M rows: sizes only matter for the access pattern
    offsets = [sum(primes[:i]) for i in range(cols)]
    table = torch.randn(sum(primes), ENGRAM_DIM, dtype=BF16, device="cuda")
    mult = [int(m) * 2 + 1 for m in torch.randint(1, 2**30, (ENGRAM_LOOK + 1,), generator=gen)]
    cids = torch.randint(0, 16384, (batch, ENGRAM_LOOK + new), generator=gen).cuda()
    attrs = (mult, primes, offsets, 3, ENGRAM_HEADS)
    variants = {"aot" + ("" if aligned else "_unaligned"):
                engram_trt.aot_launch(cids.shape, table.shape, BF16, *attrs, aligned=aligned)
                for aligned in (True, False)}

    def outputs():
        return [torch.empty(batch, new, cols, ENGRAM_DIM, dtype=BF16, device="cuda")]
    return compare(f"engram {batch}x{new}", lambda: engram_kernel.engram_hash_gather(cids, table, *attrs),
                   variants, [cids, table], outputs, 0.0)


def mhc_case(tokens: int, gen, settings: dict | None = None) -> dict:
    """settings: label -> (aligned, tokens_hint, launch_config overrides); by default the plugin's
    tactics, and the first compiled for any pointer alignment."""
    args = [a.cuda() for a in mhc_inputs(tokens, gen)]
    attrs = (20, 1e-6, 1e-6)
    launcher = mhc_kernel.MhcBoundaryLauncher()
    default = {**{f"tactic{t}": (True, *mhc_trt.tactic_setting(t)) for t in (1, 2, 3)},
               "tactic1_unaligned": (False, *mhc_trt.tactic_setting(1))}
    settings = settings or default
    variants = compiled(settings, lambda aligned, hint, over: mhc_trt.aot_launch(
        args[0].shape, BF16, *attrs, aligned=aligned, tokens_hint=hint, overrides=over))
    if settings is default:  # decoder_step's split form: partials tactic, finish tactic
        variants |= {f"split_form_tactic{p}{f}": mhc_split_form(tuple(args[0].shape), tuple(args[5].shape),
                                                                 attrs, p, f)
                     for p, f in ((1, 1), (2, 1), (2, 2), (3, 2))}
    c, e = args[0].shape[2:]

    def outputs():
        f32 = torch.float32
        return [torch.empty_like(args[0]), torch.empty(1, tokens, e, dtype=BF16, device="cuda"),
                torch.empty(1, tokens, c, dtype=f32, device="cuda"),
                torch.empty(1, tokens, c, dtype=f32, device="cuda"),
                torch.empty(1, tokens, c, c, dtype=f32, device="cuda")]
    res = compare(f"mhc tokens={tokens}", lambda: launcher(*args, *attrs), variants, args, outputs, 1e-2)
    if settings is default:  # the split form's two JIT launches (split_form.py), for comparison
        split = mhc_splits.export_attrs(e)

        def jit_split():
            new, x_raw, mixes, sums = mhc_split_jit.mhc_boundary_partials(*args[:6], **split)
            return (new, *mhc_split_jit.mhc_boundary_finish(x_raw, mixes, sums, *args[6:], *attrs))
        if _close(jit_split(), launcher(*args, *attrs), 1e-2):
            res["jit_split_form_us"] = 1e3 * time_ms(jit_split, graph=True)
        else:
            log.warning("mhc tokens=%d: the JIT split form's result differs, not timed", tokens)
    return res


def sweep(gen) -> dict:
    """Launch settings of the AOT kernels that have no channel or key split (mHC, attention) at
    decode sizes, where one program per token or head block leaves most of the GPU idle: the
    candidates for their tactics."""
    mhc = {f"hint{hint} {over}": (True, hint, over) for hint in (1, 4, 64, 1 << 20)
           for over in ({}, {"num_warps": 8})}
    mhc |= {f"hint{hint} {over}": (True, hint, over) for hint in (1, 4)
            for over in ({"BLOCK_E": 64}, {"BLOCK_E": 128, "num_warps": 8}, {"num_stages": 2},
                         {"num_stages": 4})}
    mhc |= {f"hint{hint} {over}": (True, hint, over) for hint in (1, 4, 64)  # clusters of 8 CTAs
            for over in ({"CLUSTER": 8}, {"CLUSTER": 8, "num_warps": 8}, {"CLUSTER": 8, "BLOCK_E": 64})}
    attn = {str(over): (True, over) for over in (
        {}, {"num_stages": 1}, {"num_stages": 2}, {"num_stages": 4}, {"BLOCK_K": 64},
        {"BLOCK_K": 64, "num_stages": 2}, {"num_warps": 8}, {"BLOCK_K": 64, "num_warps": 8}, {"BLOCK_H": 32},
        {"BLOCK_H": 32, "num_warps": 8}, {"BLOCK_H": 64, "num_warps": 8})}
    res = {f"mhc tokens={t}": mhc_case(t, gen, mhc) for t in (1, 8, 64)}
    res |= {f"attention rows={r}": attention_case(r, gen, attn) for r in (1, 64)}
    return res


def report(res: dict) -> None:
    print(f"\nAOT (TensorRT's kernels, run by the CUDA driver) against the JIT launchers, {res['gpu']}, "
          f"{res['date']}")
    print(f"{'case':<24} {'JIT':>9}  AOT variants (x JIT time)")
    for case, r in res["cases"].items():
        aot = [f"{k[:-3]} {v:.1f} us ({v / r['jit_us']:.2f}x)" for k, v in r.items()
               if k.endswith("_us") and k != "jit_us"]
        print(f"{case:<24} {r['jit_us']:>6.1f} us  " + "; ".join(aot))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sweep", action="store_true", help="also sweep mHC and attention AOT launch settings")
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep")
    ap.add_argument("--only", default="", help="only the cases whose name contains this, e.g. mhc")
    ap.add_argument("--attention-rows", default="1,16,64,128",
                    help="query rows of the attention cases, comma-separated")
    ap.add_argument("--attention-decode", action="store_true",
                    help="the attention cases in decoder_step's shapes: ROWS sequences of one row each")
    ap.add_argument("--split-attrs", default="",
                    help="also time the attention's split form under these split attributes: "
                         "BLOCK_KEYS:SPLIT_TARGET,... (e.g. 64:66,64:132)")
    args = ap.parse_args()
    split_attrs = []
    for pair in filter(None, args.split_attrs.split(",")):
        keys, _, target = pair.partition(":")
        if not (keys.isdigit() and target.isdigit()):
            ap.error(f"--split-attrs {pair!r}: want BLOCK_KEYS:SPLIT_TARGET, two positive ints")
        split_attrs.append((int(keys), int(target)))
    if not all(r.isdigit() and int(r) >= 1 for r in args.attention_rows.split(",")):
        ap.error(f"--attention-rows {args.attention_rows!r}: want positive ints, comma-separated")
    attention_rows = [int(r) for r in args.attention_rows.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "torch": torch.__version__, "triton": triton.__version__, "cases": {}}
    cases = [("index n=16384", lambda: index_case(16384, gen)),
             ("index n=131072", lambda: index_case(131072, gen))]
    label = "batch" if args.attention_decode else "rows"
    cases += [(f"attention {label}={r}", lambda r=r: attention_case(r, gen, split_attrs=split_attrs,
                                                                     decode=args.attention_decode))
              for r in attention_rows]
    cases += [("engram decode b=1", lambda: engram_case(1, 1, gen)),
              ("engram prefill 8192", lambda: engram_case(1, 8192, gen)),
              ("mhc tokens=1", lambda: mhc_case(1, gen)), ("mhc tokens=4", lambda: mhc_case(4, gen)),
              ("mhc tokens=64", lambda: mhc_case(64, gen)), ("mhc tokens=8192", lambda: mhc_case(8192, gen))]
    cases = [(name, case) for name, case in cases if args.only in name]
    for name, case in tqdm([] if args.sweep_only else cases, desc="aot"):
        res["cases"][name] = case()
        torch.cuda.empty_cache()
        (out / "bench_aot.json").write_text(json.dumps(res, indent=1))
    report(res)
    if args.sweep or args.sweep_only:
        res["sweep"] = sweep(gen)
        (out / "bench_aot.json").write_text(json.dumps(res, indent=1))
        for case, r in res["sweep"].items():
            timed = [(v, k[:-3]) for k, v in r.items()
                     if k.endswith("_us") and k != "jit_us" and not math.isnan(v)]
            best = sorted(timed)[:4]
            log.info("sweep best %s (JIT %.1f us): %s", case, r["jit_us"],
                     "; ".join(f"{v:.1f} us {k}" for v, k in best))


if __name__ == "__main__":
    main()
