"""Graph checks of a low-precision (bf16) bundle: PIPELINE.md §7's kernel rule over a run of steps.

Fixed tolerances (export/accuracy.py) do not fit bf16 graphs, and ONNX Runtime's CPU provider has
no bf16 kernels, so a bf16 bundle's graphs run on an engine that has them (the CUDA provider,
`ort-cuda`) and each step is compared three ways on the same feeds: the graph, the PyTorch
reference in the bundle's dtype, and the model in float32 (truth; bf16's errors are ~10^4 times
fp32's). Prompts are prefilled one slot at a time (replay), then the batch decodes K steps,
teacher-forced by the reference (its outputs fill the cache). Per float output, the graph's errors
over all steps must pass `steps_verdict` against the reference's; integer outputs (groups, Engram
history, lengths) must equal the reference's, and every output must have the reference's dtype
and shape.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field

import torch

from dsflash.export.contract import GRAPHS
from dsflash.export.graphs import GraphModule
from dsflash.export.tolerances import StepsVerdict, relative_error, steps_verdict
from dsflash.model.model import DSFlashModel, encoder_rows

log = logging.getLogger(__name__)


@dataclass
class LowpReport:
    dtype: torch.dtype
    steps: int = 0
    verdicts: dict[str, StepsVerdict] = field(default_factory=dict)  # "graph:output" -> verdict
    errors: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # per step
    mismatch: str | None = None  # the first output of another dtype or shape, or integers that differ

    @property
    def passed(self) -> bool:
        return self.mismatch is None and all(v.passed for v in self.verdicts.values())

    def failures(self) -> list[str]:
        out = [self.mismatch] if self.mismatch else []
        return out + [f"{name}: median error {v.median:.3g} > bound {v.bound:.3g}" if v.median > v.bound
                      else f"{name}: {v.flips} flips (reference {v.reference_flips})"
                      for name, v in self.verdicts.items() if not v.passed]


def _check_scenario(engines: dict, model: DSFlashModel, prompts: list[list[int]], decode_steps: int) -> None:
    if next(model.parameters()).dtype == torch.float32:
        raise ValueError("check_lowp_bundle is for low-precision models; float32 bundles take "
                         "export.accuracy.check_bundle's fixed tolerances")
    missing = [g for g in GRAPHS if g not in engines]
    if missing:
        raise ValueError(f"engines lack the graphs {missing} (have {sorted(engines)})")
    if not prompts or decode_steps < 1:
        raise ValueError(f"need prompts and at least one decode step (got {len(prompts)} prompts, "
                         f"{decode_steps} steps)")


def check_lowp_bundle(engines: dict, model: DSFlashModel, prompts: list[list[int]],
                      decode_steps: int) -> LowpReport:
    """Run the scenario through `engines` (one per graph, e.g. make_engines("ort-cuda", bundle))
    against `model`: the reference in the bundle's low dtype with the exported weights, on the
    device where the cache should live (the GPU for ort-cuda, which then reads it in place)."""
    from dsflash.runtime.cache_manager import CacheManager
    from dsflash.runtime.generator import Generator
    from dsflash.runtime.request import GenerationParams

    _check_scenario(engines, model, prompts, decode_steps)
    cfg, dtype, device = model.cfg, next(model.parameters()).dtype, next(model.parameters()).device
    capacity = max(len(p) for p in prompts) + decode_steps + 1
    cache = CacheManager(cfg, len(prompts), capacity, device=device, dtype=dtype)
    # the runtime's own prompt checks (integer ids inside the vocabulary, non-empty), before any graph
    admit = Generator(engines, cache).check_request
    prompts = [admit(p, GenerationParams(max_new_tokens=decode_steps)) for p in prompts]
    low = model.eval()
    truth_model = copy.deepcopy(low).float()  # bf16 weights are exact in fp32
    modules = {g: (GraphModule(low, g), GraphModule(truth_model, g)) for g in GRAPHS}
    report = LowpReport(dtype)

    def step(graph: str, slots: list[int], ids: torch.Tensor) -> torch.Tensor | None:
        feeds = cache.feeds(slots, engines[graph].input_names, ids)
        got = engines[graph].run(feeds)
        reference, truth = modules[graph]
        with torch.no_grad():
            ref = dict(zip(reference.output_names, reference(*feeds.values())))
            exact = dict(zip(truth.output_names,
                             truth(*(t.float() if t.is_floating_point() else t for t in feeds.values()))))
        for name, want in exact.items():
            g, r, where = got[name], ref[name], f"step {report.steps} ({graph}): {name}"
            if (g.dtype, g.shape) != (r.dtype, r.shape):
                why = f"{where} is {g.dtype} {list(g.shape)}, the reference's {r.dtype} {list(r.shape)}"
            elif want.is_floating_point():
                report.errors.setdefault(f"{graph}:{name}", []).append(
                    (relative_error(g, want), relative_error(r, want)))
                continue
            elif not torch.equal(g.cpu(), r.cpu()):
                why = f"{where} differs from the reference"
            else:
                continue
            report.mismatch = report.mismatch or why
        report.steps += 1
        cache.write(graph, slots, ref, feeds["seq_len"])  # teacher-forced: the reference's state
        return ref.get("logits")  # encoder_prefill has none

    last = []
    for prompt in prompts:
        slot, ids = cache.acquire(), torch.tensor([prompt])
        split = encoder_rows(cfg, len(prompt), "replay")
        if split:
            step("encoder_prefill", [slot], ids[:, :split])
        last.append(step("decoder_step", [slot], ids[:, split:]))
    tokens = torch.cat(last).argmax(-1, keepdim=True)
    for _ in range(decode_steps):
        tokens = step("decoder_step", list(range(len(prompts))), tokens).argmax(-1, keepdim=True)
    report.verdicts = {k: steps_verdict(v, dtype) for k, v in report.errors.items()}
    for name, v in report.verdicts.items():
        log.info("%s: median error %.3g (reference %.3g, bound %.3g), flips %d (reference %d)",
                 name, v.median, v.reference_median, v.bound, v.flips, v.reference_flips)
    return report
