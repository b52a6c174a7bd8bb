"""ONNX Runtime's CUDA provider with IOBinding and a device-resident cache (onnxruntime-gpu on
the H200; scripts/gpu_check.sh). Needs a portable tiny bundle at $DSFLASH_TINY_BUNDLE (the GPU
machine cannot export quickly; the bundle is made here and carried). Skipped elsewhere."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu


def _cuda_provider() -> bool:
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.skipif(not _cuda_provider(), reason="needs onnxruntime-gpu and a CUDA GPU")
@pytest.mark.skipif("DSFLASH_TINY_BUNDLE" not in os.environ, reason="set DSFLASH_TINY_BUNDLE to a portable tiny bundle")
def test_ort_cuda_iobinding_gives_reference_tokens(gen):
    from conftest import random_ids
    from dsflash.export.bundle import Bundle
    from dsflash.model.generate import generate
    from dsflash.runtime.cache_manager import CacheManager
    from dsflash.runtime.engine import make_engines
    from dsflash.runtime.generator import Generator
    from dsflash.runtime.request import GenerationParams
    from dsflash.runtime.weights import model_from_bundle

    bundle = Bundle.open(os.environ["DSFLASH_TINY_BUNDLE"])
    cfg = bundle.config
    model = model_from_bundle(bundle)
    prompts = [random_ids(gen, 1, n, cfg.vocab_size)[0].tolist() for n in (14, 3, 9)]
    expected = [generate(model, [p], 8)[0] for p in prompts]
    engines = make_engines("ort-cuda", bundle=bundle)
    assert all(e.on_cuda for e in engines.values())
    # one step first: the same logits as the CPU reference within the graph tolerance
    from dsflash.model.cache import ModelCache
    from dsflash.runtime.engine import TorchEngine
    from tolerances import MODEL, assert_close

    cache = ModelCache.allocate(cfg, 1, 64)
    feeds = {"ids": torch.tensor([prompts[0][:5]]), **cache.gather(cache.slot_index([0]))}
    ref = TorchEngine(model, "decoder_step").run(feeds)["logits"]
    got = engines["decoder_step"].run({k: v.cuda() for k, v in feeds.items()})["logits"]
    assert_close(got.cpu(), ref, MODEL, "ort-cuda logits")
    manager = CacheManager(cfg, 2, 64, device="cuda")
    g = Generator(engines, manager)
    ids = [g.add(p, GenerationParams(max_new_tokens=8)) for p in prompts]  # the third one queues
    done = g.run()
    assert [done[i].tokens for i in ids] == expected
    assert all(t.is_cuda for t in manager.cache.tensors.values())  # the state never left the GPU
    feeds = manager.feeds([0], engines["decoder_step"].input_names, torch.tensor([[1]]))
    outs = engines["decoder_step"].run(feeds)
    assert all(t.is_cuda for t in outs.values())
