#!/usr/bin/env python3
"""Check a bundle's ONNX graphs against the PyTorch reference with Polygraphy: a prefill of two
prompts of different lengths (replay), then K teacher-forced decode steps of the batch. Writes the
feeds and reference outputs as Polygraphy JSON (for `polygraphy run`) and exits non-zero on a
mismatch, naming the first diverging step and output.

    python scripts/check_accuracy.py --bundle engines/tiny [--flavor both] [--steps 8] [--provider cuda]

A bfloat16 bundle (ONNX Runtime's CPU provider has no bf16 kernels) is checked on a GPU: its
portable graphs on the CUDA provider (onnxruntime-gpu), each step against the reference in bf16
and the model in float32, by the kernel rule over the run (export/accuracy_lowp.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from dsflash.export.accuracy import check_bundle, reference_steps
from dsflash.export.accuracy_lowp import check_lowp_bundle
from dsflash.export.bundle import Bundle
from dsflash.export.ort_session import cuda_providers
from dsflash.model.model import DSFlashModel
from dsflash.model.weights import load_safetensors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--flavor", default="both", choices=["plugin", "portable", "both"])
    ap.add_argument("--steps", type=int, default=8, help="teacher-forced decode steps")
    ap.add_argument("--prompt-lens", default="13,5", help="comma-separated prompt lengths")
    ap.add_argument("--checkpoint", help="weights of the bundle (default: the export's seeded weights)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the export's random weights")
    ap.add_argument("--save", type=Path, help="folder for the Polygraphy inputs/outputs JSON")
    ap.add_argument("--provider", default="cpu", choices=["cpu", "cuda"],
                    help="ONNX Runtime's provider for float32 bundles: cuda checks the portable graphs "
                         "as ort-cuda runs them (onnxruntime-gpu); bfloat16 bundles always take cuda")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    bundle = Bundle.open(args.bundle)
    model = DSFlashModel(bundle.config).eval()
    if args.checkpoint:
        load_safetensors(model, args.checkpoint)
    else:
        model.init_weights(args.seed)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, bundle.config.vocab_size, (int(n),), generator=gen).tolist()
               for n in args.prompt_lens.split(",")]
    if bundle.dtype != torch.float32:
        return check_low_precision(ap, bundle, model.to(bundle.dtype), prompts, args)
    flavors = bundle.flavors if args.flavor == "both" else [args.flavor]
    providers = None
    if args.provider == "cuda":
        if args.flavor == "plugin" or "portable" not in bundle.flavors:
            ap.exit(2, f"{ap.prog}: error: --provider cuda checks the portable graphs (the plugin "
                       "ops run on the CPU provider)\n")
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            ap.exit(2, f"{ap.prog}: error: --provider cuda needs onnxruntime-gpu (this onnxruntime "
                       f"{ort.__version__} offers {ort.get_available_providers()})\n")
        flavors, providers = ["portable"], cuda_providers()
    steps = reference_steps(model, prompts, args.steps)
    ok = True
    for flavor in flavors:
        report = check_bundle(bundle, model, flavor, steps, providers=providers,
                              save_dir=args.save / flavor if args.save else None)
        worst = max(report.max_abs_error.items(), key=lambda kv: kv[1])
        status = "PASSED" if report.passed else f"FAILED at {report.first_failure}"
        print(f"{flavor}: {status} over {report.steps} steps; largest |error| {worst[1]:.2e} ({worst[0]})")
        for flip in report.flips:  # kv_qat models: steps that differ by a rounding flip only
            print(f"  {flip}")
        ok &= report.passed
    return 0 if ok else 1


def check_low_precision(ap, bundle: Bundle, model: DSFlashModel, prompts, args) -> int:
    from dsflash.runtime.engine import make_engines

    why = None
    if args.flavor == "plugin" or "portable" not in bundle.flavors:
        why = (f"a {bundle.manifest['dtype']} bundle is checked in the portable flavor on ONNX "
               "Runtime's CUDA provider (the plugin ops run on the CPU provider, which has no bf16 kernels)")
    elif args.save:
        why = "--save writes Polygraphy JSON, which has no bfloat16: it is for float32 bundles"
    elif not torch.cuda.is_available():
        why = (f"a {bundle.manifest['dtype']} bundle's graphs are checked on a CUDA GPU with "
               "onnxruntime-gpu (ONNX Runtime's CPU provider has no bf16 kernels); no GPU here")
    if why:
        ap.exit(2, f"{ap.prog}: error: {why}\n")
    report = check_lowp_bundle(make_engines("ort-cuda", bundle=bundle), model.cuda(), prompts, args.steps)
    print(f"portable on ort-cuda: {'PASSED' if report.passed else 'FAILED'} over {report.steps} steps")
    for name, v in report.verdicts.items():
        print(f"  {name}: median error {v.median:.3g} (reference {v.reference_median:.3g}, bound "
              f"{v.bound:.3g}), flips {v.flips} (reference {v.reference_flips})")
    for failure in report.failures():
        print(f"  FAILED {failure}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
