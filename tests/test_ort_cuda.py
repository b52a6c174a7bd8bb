"""ONNX Runtime's CUDA provider with IOBinding and a device-resident cache (onnxruntime-gpu on
the H200; scripts/gpu_check.sh). Needs a portable tiny bundle at $DSFLASH_TINY_BUNDLE (the GPU
machine cannot export quickly; the bundle is made here and carried). Skipped elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

from tolerances import MODEL, assert_close


def _cuda_provider() -> bool:
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _cuda_provider(), reason="needs onnxruntime-gpu and a CUDA GPU"),
              pytest.mark.skipif("DSFLASH_TINY_BUNDLE" not in os.environ,
                                 reason="set DSFLASH_TINY_BUNDLE to a portable tiny bundle")]


@pytest.fixture
def step_case():
    from dsflash.export.bundle import Bundle
    from dsflash.model.cache import ModelCache

    bundle = Bundle.open(os.environ["DSFLASH_TINY_BUNDLE"])
    cache = ModelCache.allocate(bundle.config, 1, 64)
    feeds = {"ids": torch.tensor([[5, 9, 100, 7, 3]]), **cache.gather(cache.slot_index([0]))}
    return bundle, feeds


def test_iobinding_equals_a_plain_cuda_run_and_stays_on_the_gpu(step_case):
    """The bound path hands ONNX Runtime torch's device pointers and preallocated outputs: it must
    give exactly what the same CUDA session gives through numpy, and never leave the GPU."""
    from dsflash.runtime.engine import make_engines

    bundle, feeds = step_case
    engine = make_engines("ort-cuda", bundle=bundle)["decoder_step"]
    assert engine.on_cuda
    bound = engine.run({k: v.cuda() for k, v in feeds.items()})
    plain = engine.session.run(engine.output_names, {n: feeds[n].numpy() for n in engine.input_names})
    for name, p in zip(engine.output_names, plain):
        assert bound[name].is_cuda, name
        assert torch.equal(bound[name].cpu(), torch.from_numpy(p)), name


def test_cuda_provider_gives_reference_logits_and_tokens(step_case, gen):
    """Exact fp32 on the CUDA provider (no TF32): one step's logits within the graph tolerance,
    then greedy generation with a GPU-resident cache equals the PyTorch reference run one prompt
    at a time (three prompts on two slots, so one queues)."""
    from dsflash.model.generate import generate
    from dsflash.runtime.cache_manager import CacheManager
    from dsflash.runtime.engine import OrtEngine, make_engines
    from dsflash.runtime.generator import Generator
    from dsflash.runtime.request import GenerationParams
    from dsflash.runtime.weights import model_from_bundle

    from conftest import random_ids

    bundle, feeds = step_case
    engines = make_engines("ort-cuda", bundle=bundle)
    cpu = OrtEngine(bundle, "decoder_step").run(feeds)["logits"]
    got = engines["decoder_step"].run({k: v.cuda() for k, v in feeds.items()})["logits"]
    assert_close(got.cpu(), cpu, MODEL, "ort-cuda logits vs ort-cpu")
    cfg = bundle.config
    model = model_from_bundle(bundle)
    prompts = [random_ids(gen, 1, n, cfg.vocab_size)[0].tolist() for n in (14, 3, 9)]
    expected = [generate(model, [p], 8)[0] for p in prompts]
    manager = CacheManager(cfg, 2, 64, device="cuda")
    g = Generator(engines, manager)
    ids = [g.add(p, GenerationParams(max_new_tokens=8)) for p in prompts]
    done = g.run()
    assert [done[i].tokens for i in ids] == expected
    assert all(t.is_cuda for t in manager.cache.tensors.values())


def test_the_polygraphy_check_passes_on_the_cuda_provider(step_case, gen):
    """scripts/check_accuracy.py --provider cuda: the portable graphs on the CUDA provider (fp32,
    no TF32, no memory reuse) within the fp32 graph tolerance of the reference over two prefills
    and 8 teacher-forced decode steps. Needs polygraphy (pure Python; the GPU machine lacks it:
    carry its wheel like onnxruntime-gpu's)."""
    pytest.importorskip("polygraphy")
    from dsflash.export.accuracy import check_bundle, reference_steps
    from dsflash.export.ort_session import cuda_providers
    from dsflash.runtime.weights import model_from_bundle

    from conftest import random_ids

    bundle, _ = step_case
    model = model_from_bundle(bundle)
    prompts = [random_ids(gen, 1, n, bundle.config.vocab_size)[0].tolist() for n in (19, 5)]
    steps = reference_steps(model, prompts, decode_steps=8)
    report = check_bundle(bundle, model, "portable", steps, providers=cuda_providers())
    assert report.passed, report.first_failure
    assert report.steps == 11


@pytest.fixture
def bf16_bundle():
    from dsflash.export.bundle import Bundle

    path = os.environ.get("DSFLASH_TINY_BF16_BUNDLE")
    if path is None:
        pytest.skip("set DSFLASH_TINY_BF16_BUNDLE to a bfloat16 portable tiny bundle")
    bundle = Bundle.open(path)
    assert bundle.dtype == torch.bfloat16, bundle.dtype
    return bundle


def test_bf16_graphs_on_the_cuda_provider_meet_the_low_precision_rule(bf16_bundle, gen):
    """PIPELINE.md §7's rule applied to a bf16 bundle's graphs (the CPU provider has no bf16
    kernels, so they are checked here; export/accuracy_lowp.py): two prefills and 30
    teacher-forced decode steps of both sequences, each call against the bf16 reference and the
    model in fp32. A bf16 run flips discrete choices (MoE routing, index top-k) at some steps,
    the graph and the reference at partly different ones (H100, 2026-12-05, logits over 17
    calls: both at 3, the graph alone at 3, the reference alone at 1), so per float output the
    graph's median error is held to the rule and its flips are counted (steps_verdict). Every
    output has the reference's dtype and shape; integer outputs are exact."""
    from dsflash.export.accuracy_lowp import check_lowp_bundle
    from dsflash.runtime.engine import make_engines
    from dsflash.runtime.weights import model_from_bundle

    from conftest import random_ids

    cfg = bf16_bundle.config
    engines = make_engines("ort-cuda", bundle=bf16_bundle)
    prompts = [random_ids(gen, 1, n, cfg.vocab_size)[0].tolist() for n in (21, 6)]
    report = check_lowp_bundle(engines, model_from_bundle(bf16_bundle).cuda(), prompts, decode_steps=30)
    assert report.steps == 3 + 30
    checked = {"decoder_step:logits", "decoder_step:new_swa_rows", "encoder_prefill:new_kv.1"}
    assert checked <= set(report.verdicts)
    assert report.passed, report.failures()
