"""Graph checks against PyTorch with Polygraphy (PIPELINE.md §7).

A scenario (prompts of different lengths prefilled one slot at a time, replay by default, then
K teacher-forced decode steps of the whole batch) is run once through the reference graphs
(`GraphModule` on the PyTorch model), recording each step's feeds and outputs as Polygraphy
`RunResults`. ONNX Runtime runners (sessions built by dsflash, so plugin graphs run) then run the
same feeds step by step, and Polygraphy compares with the tolerance table. The report names the
first step and output that diverges. In kv_qat models a step that differs by a rounding flip
(export/rounding_flips.py) is reported as one, not as a failure, while flips stay rare.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dsflash.export.bundle import Bundle
from dsflash.export.contract import GRAPHS
from dsflash.export.graphs import GraphModule, additions_for_cache
from dsflash.export.rounding_flips import explain_flip
from dsflash.export.tolerances import graph_tolerance
from dsflash.model.cache import ModelCache
from dsflash.model.model import DSFlashModel, encoder_rows

log = logging.getLogger(__name__)
REFERENCE = "pytorch-reference"
# kv_qat checks fail when more than one step in this many is a rounding flip (rounding_flips.py)
MAX_FLIP_STEP_FRACTION = 4


@dataclass(eq=False)
class Step:
    graph: str
    feeds: OrderedDict[str, np.ndarray]
    outputs: OrderedDict[str, np.ndarray]


@dataclass
class CheckReport:
    flavor: str
    passed: bool
    steps: int
    first_failure: str | None = None
    max_abs_error: dict[str, float] = field(default_factory=dict)
    # kv_qat checks: "step k (graph call i): rounding flip at layer ..." (export/rounding_flips.py)
    flips: list[str] = field(default_factory=list)


def reference_steps(model: DSFlashModel, prompts: list[list[int]], decode_steps: int,
                    mode: str = "replay") -> list[Step]:
    """Run the scenario through the reference graphs; greedy tokens drive the decode feeds."""
    cfg = model.cfg
    capacity = max(len(p) for p in prompts) + decode_steps + 1
    cache = ModelCache.allocate(cfg, len(prompts), capacity, dtype=model.embed.weight.dtype)
    modules = {g: GraphModule(model, g) for g in GRAPHS}
    steps: list[Step] = []

    def run(graph: str, slots: list[int], ids: torch.Tensor):
        idx = torch.tensor(slots)
        state = cache.gather(idx)
        feeds = OrderedDict((n, ids if n == "ids" else state[n]) for n in modules[graph].input_names)
        with torch.no_grad():
            outs = modules[graph](*feeds.values())
        named = OrderedDict(zip(modules[graph].output_names, outs))
        cache.write(additions_for_cache(cfg, graph, named, state["seq_len"]), idx)
        steps.append(Step(graph, OrderedDict((k, v.numpy().copy()) for k, v in feeds.items()),
                          OrderedDict((k, v.numpy().copy()) for k, v in named.items())))
        return named

    last = []
    for slot, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        split = encoder_rows(cfg, len(prompt), mode)
        if split:
            run("encoder_prefill", [slot], ids[:, :split])
        last.append(run("decoder_step", [slot], ids[:, split:])["logits"])
    tokens = torch.cat(last).argmax(-1, keepdim=True)
    for _ in range(decode_steps):
        tokens = run("decoder_step", list(range(len(prompts))), tokens)["logits"].argmax(-1, keepdim=True)
    return steps


def check_bundle(bundle: Bundle, model: DSFlashModel, flavor: str, steps: list[Step],
                 save_dir: Path | None = None, providers: list | None = None) -> CheckReport:
    """Compare ONNX Runtime on the bundle's `flavor` graphs with the reference steps. providers:
    ONNX Runtime's (default the CPU's); asking for CUDA (ort_session.cuda_providers()) checks the
    graphs as ort-cuda runs them, and fails if the CUDA provider is not enabled."""
    from polygraphy.backend.onnxrt import OnnxrtRunner
    from polygraphy.comparator import Comparator
    from polygraphy.comparator.compare import SimpleCompareFunc
    from polygraphy.comparator.struct import IterationResult

    from dsflash.export.ort_session import asks_for_cuda

    tol = graph_tolerance(model.embed.weight.dtype)
    on_cuda = asks_for_cuda(providers)
    report = CheckReport(flavor=flavor, passed=True, steps=len(steps))
    for graph in GRAPHS:
        mine = [s for s in steps if s.graph == graph]
        if not mine:
            continue
        runner_name = f"onnxruntime-{flavor}" + ("-cuda" if on_cuda else "")
        runner = OnnxrtRunner(lambda g=graph: _session(bundle, g, flavor, providers, on_cuda),
                              name=runner_name)
        results = Comparator.run([runner], data_loader=[s.feeds for s in mine])
        results.append((REFERENCE, [IterationResult(outputs=s.outputs, runner_name=REFERENCE) for s in mine]))
        accuracy = Comparator.compare_accuracy(
            results, compare_func=SimpleCompareFunc(atol=tol["atol"], rtol=tol["rtol"],
                                                    check_error_stat="elemwise"))
        _record_errors(report, graph, results, runner_name)
        if save_dir is not None:
            _save(save_dir, graph, flavor, mine, results)
        failing = _failing_iterations(accuracy)
        if model.cfg.kv_qat:
            failing = _without_flips(report, failing, results, runner_name, mine, graph, steps, tol)
        if failing:
            report.passed = False
            if report.first_failure is None:
                report.first_failure = _first_failure(accuracy, mine, graph, steps, failing)
    if len(report.flips) > max(1, len(steps) // MAX_FLIP_STEP_FRACTION):
        report.passed = False
        report.first_failure = report.first_failure or (
            f"rounding flips at {len(report.flips)} of {len(steps)} steps: more than one in "
            f"{MAX_FLIP_STEP_FRACTION}")
    return report


def _session(bundle: Bundle, graph: str, flavor: str, providers: list | None, on_cuda: bool):
    from dsflash.export.ort_session import ort_session, require_cuda

    session = ort_session(bundle, graph, flavor, providers)
    if on_cuda:
        require_cuda(session, f"{graph} ({flavor})")
    return session


def _failing_iterations(accuracy) -> set[int]:
    return {i for result in accuracy for per_iteration in result.values()
            for i, outputs in enumerate(per_iteration) if not all(bool(ok) for ok in outputs.values())}


def _without_flips(report: CheckReport, failing: set[int], results, runner_name: str, mine: list[Step],
                   graph: str, steps: list[Step], tol: dict) -> set[int]:
    """The failing iterations that a rounding flip does not explain; the others go to report.flips."""
    ours = dict(results.items())[runner_name]
    left = set()
    for i in sorted(failing):
        got = {name: np.asarray(value) for name, value in ours[i].items()}
        why = explain_flip(got, mine[i].outputs, tol)
        if why is None:
            left.add(i)
        else:
            step = next(k for k, st in enumerate(steps) if st is mine[i])
            report.flips.append(f"step {step} ({graph} call {i}): {why}")
            log.info("step %d (%s call %d): %s", step, graph, i, why)
    return left


def _record_errors(report: CheckReport, graph: str, results, runner_name: str) -> None:
    ours = dict(results.items())[runner_name]
    ref = dict(results.items())[REFERENCE]
    for it_o, it_r in zip(ours, ref):
        for name, value in it_r.items():
            got = np.asarray(it_o[name], dtype=np.float64)
            err = float(np.max(np.abs(got - np.asarray(value, dtype=np.float64)))) if value.size else 0.0
            key = f"{graph}:{name}"
            report.max_abs_error[key] = max(report.max_abs_error.get(key, 0.0), err)


def _first_failure(accuracy, mine: list[Step], graph: str, steps: list[Step], failing: set[int]) -> str:
    for result in accuracy:  # one AccuracyResult per comparison function
        for per_iteration in result.values():
            for i, outputs in enumerate(per_iteration):
                for name, ok in outputs.items():
                    if not bool(ok) and i in failing:
                        step = next(k for k, st in enumerate(steps) if st is mine[i])
                        return f"step {step} ({graph} call {i}), output {name}"
    return f"{graph}: outputs differ"


def _save(save_dir: Path, graph: str, flavor: str, mine: list[Step], results) -> None:
    from polygraphy.comparator import RunResults
    from polygraphy.json import save_json

    save_dir.mkdir(parents=True, exist_ok=True)
    save_json([s.feeds for s in mine], str(save_dir / f"{graph}.inputs.json"))
    ref = RunResults()
    ref.append((REFERENCE, dict(results.items())[REFERENCE]))
    ref.save(str(save_dir / f"{graph}.reference.json"))
