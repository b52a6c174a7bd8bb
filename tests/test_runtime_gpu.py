"""The runtime on the GPU: CUDA graphs that read the cache pools in place (runtime/cuda_graph.py).
Run on the H200 by scripts/gpu_check.sh; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_graphed_step_reads_resident_inputs_in_place_and_copies_the_rest():
    from dsflash.runtime.cuda_graph import GraphedStep

    pool = torch.zeros(4, 8, device="cuda")

    def fn(x, state):
        return (x * 2 + state.sum(0),)

    step = GraphedStep(fn, max_graphs=2)
    x = torch.ones(8, device="cuda")
    view = pool[:2]
    assert torch.equal(step(x, view, resident=[1])[0], torch.full((8,), 2.0, device="cuda"))
    pool[:2] += 1.0  # between calls, in place (as the cache manager writes a step's additions)
    assert torch.equal(step(x * 3, pool[:2], resident=[1])[0], torch.full((8,), 8.0, device="cuda"))
    assert step.captured == 1  # same addresses: the same graph, nothing copied in for the state
    # a gathered copy of the same shape is copied into the graph's own buffer (its own graph)
    copy = pool[:2].clone() * 10
    assert torch.equal(step(x, copy)[0], torch.full((8,), 22.0, device="cuda"))
    assert step.captured == 2
    # another run of slots has other addresses: a graph of its own, the oldest one evicted
    pool[2:] = 5.0
    assert torch.equal(step(x, pool[2:], resident=[1])[0], torch.full((8,), 12.0, device="cuda"))
    assert step.captured == 2
    assert torch.equal(step(x, pool[:2], resident=[1])[0], torch.full((8,), 4.0, device="cuda"))
    with pytest.raises(ValueError, match=r"resident input positions \[2\] outside the 2 inputs"):
        step(x, view, resident=[2])


def test_generator_decodes_through_graphs_that_read_the_cache_in_place(tiny_cfg, gen):
    """Greedy tokens through graphed Triton decode steps reading the pools in place equal the
    reference ops' eager run, and so do those of the steps compiled by inductor first
    (torch-compiled); requests finish early, so sequences move between slots. The kernel
    backends are warmed up first (Generator.warm_up), after which serving captures no graph."""
    from dsflash.model.model import DSFlashModel
    from dsflash.runtime.cache_manager import CacheManager
    from dsflash.runtime.engine import make_engines
    from dsflash.runtime.generator import Generator
    from dsflash.runtime.request import GenerationParams

    from conftest import random_ids

    prompts = [random_ids(gen, 1, n, tiny_cfg.vocab_size)[0].tolist() for n in (13, 5, 9)]
    lengths = (3, 12, 7)
    runs = {}
    for backend in ("torch", "torch-triton", "torch-compiled"):
        torch._dynamo.reset()
        model = DSFlashModel(tiny_cfg).init_weights(seed=1234).eval().cuda()
        engines = make_engines(backend, model=model)
        g = Generator(engines, CacheManager(tiny_cfg, 3, 64, device="cuda"))
        if backend != "torch":  # compile (torch-compiled) and capture every decode batch size first
            assert set(g.warm_up()) == {"decode 1", "decode 2", "decode 3"}
            warmed = list(engines["decoder_step"]._graphed._graphs)
        ids = [g.add(p, GenerationParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
        done = g.run()
        runs[backend] = [done[i].tokens for i in ids]
        if backend != "torch":
            keys = list(engines["decoder_step"]._graphed._graphs)
            assert keys and all(places for _, places in keys), "a decode step copied the cache in"
            assert set(keys) == set(warmed), "serving captured a graph the warm-up did not"
    assert runs["torch-triton"] == runs["torch"]
    assert runs["torch-compiled"] == runs["torch"]


def test_tuned_compile_step_gives_the_eager_kernels_results(tiny_cfg):
    """TUNED_COMPILE (coordinate descent tuning, which lowers one-row matmuls to fused reductions):
    the compiled decode step of 1 and of 3 sequences within MODEL of the eager kernels (fp32)."""
    from dsflash.model.model import DSFlashModel
    from dsflash.runtime.cache_manager import synthetic_cache
    from dsflash.runtime.engine import TUNED_COMPILE, TorchEngine

    from tolerances import MODEL, assert_close

    torch._dynamo.reset()
    model = DSFlashModel(tiny_cfg).init_weights(seed=11).eval().cuda()
    tuned = TorchEngine(model, "decoder_step", ops="triton", compile="inductor",
                        compile_options=TUNED_COMPILE)
    eager = TorchEngine(model, "decoder_step", ops="triton")
    for batch, context in ((1, 40), (3, 21)):
        cm = synthetic_cache(tiny_cfg, batch, context, 2, "cuda", torch.float32, seed=batch)
        ids = torch.randint(0, tiny_cfg.vocab_size, (batch, 1))
        feeds = cm.feeds(list(range(batch)), tuned.input_names, ids)
        got, want = tuned.run(feeds), eager.run(feeds)
        for name in tuned.output_names:
            assert_close(got[name].float(), want[name].float(), MODEL, f"batch {batch}: {name}")
    torch._dynamo.reset()


def test_rotary_tables_on_the_gpu_eager_and_compiled_match_the_fp64_angles():
    """The rotary tables formed on the GPU (eager, and fused by inductor as the torch-compiled
    backend runs them) stay within fp32's rounding floor of cos/sin of the fp64 angle up to 2^24
    positions: the exact-piece formulation must survive CUDA's cosf and inductor's codegen."""
    from dsflash.export.tolerances import ROUNDING_FLOOR
    from dsflash.model.config import ModelConfig
    from dsflash.model.norm_rope import POSITION_LIMIT, rope_cos_sin, rope_frequencies, rope_phase

    cfg = ModelConfig.preset("flash")
    gen = torch.Generator().manual_seed(29)
    pos = torch.cat([torch.arange(4096), torch.randint(0, POSITION_LIMIT, (100_000,), generator=gen),
                     torch.arange(POSITION_LIMIT - 4096, POSITION_LIMIT)])
    compiled = torch.compile(rope_cos_sin, fullgraph=True)
    for freqs in (rope_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, None),
                  rope_frequencies(cfg.qk_rope_head_dim, cfg.compress_rope_theta, cfg.rope_scaling)):
        angles = pos.to(torch.float64).unsqueeze(-1) * freqs
        phase = rope_phase(freqs).cuda()
        for name, fn in (("eager", rope_cos_sin), ("inductor", compiled)):
            cos, sin = fn(pos.cuda(), phase)
            err = max((cos.cpu().double() - angles.cos()).abs().max().item(),
                      (sin.cpu().double() - angles.sin()).abs().max().item())
            assert err <= ROUNDING_FLOOR[torch.float32], (name, err)


def test_serving_loop_captures_and_replays_graphs_in_its_own_thread(tiny_cfg, gen):
    """ServingLoop on the graphed Triton backend: the loop thread (not the test's) captures and
    replays the decode graphs; three threads' requests give the tokens of the reference ops'
    single-threaded run."""
    from dsflash.model.model import DSFlashModel
    from dsflash.runtime.api import Runtime
    from dsflash.runtime.cache_manager import CacheManager
    from dsflash.runtime.engine import make_engines
    from dsflash.runtime.generator import Generator
    from dsflash.runtime.request import GenerationParams
    from dsflash.runtime.serving import ServingLoop

    from conftest import random_ids, submit_from_threads

    prompts = [random_ids(gen, 1, n, tiny_cfg.vocab_size)[0].tolist() for n in (11, 4, 7)]
    params = GenerationParams(max_new_tokens=8)

    def runtime(backend):
        model = DSFlashModel(tiny_cfg).init_weights(seed=1234).eval().cuda()
        cache = CacheManager(tiny_cfg, 3, 64, device="cuda")
        return Runtime(Generator(make_engines(backend, model=model), cache), backend)

    expected = [r.tokens for r in runtime("torch").generate(prompts, params)]
    rt = runtime("torch-triton")
    with ServingLoop(rt) as loop:
        got = [h.result(timeout=300).tokens for h in submit_from_threads(loop, prompts, params)]
    assert got == expected
    assert rt.generator.engines["decoder_step"]._graphed.captured >= 1  # graphs, in the loop thread
