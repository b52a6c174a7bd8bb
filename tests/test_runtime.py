"""Runtime: engines behind one interface, cache manager, continuous batching (issue: runtime)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsflash.export.bundle import BundleError
from dsflash.model.accounting import sequence_bytes
from dsflash.model.config import ModelConfig
from dsflash.model.generate import generate
from dsflash.model.sampling import SamplingParams
from dsflash.model.model import DSFlashModel
from dsflash.runtime.api import Runtime
from dsflash.runtime.cache_manager import CacheManager
from dsflash.runtime.engine import TUNED_COMPILE, make_engines
from dsflash.runtime.generator import Generator
from dsflash.runtime.request import GenerationParams, Request
from dsflash.runtime.tokenizer import ByteTokenizer
from dsflash.runtime.weights import model_from_bundle

from conftest import random_ids


def engines_for(backend, bundle, model):
    return make_engines(backend, bundle=bundle, model=model)


@pytest.mark.parametrize("backend", ["torch", "ort", "ort-plugin"])
def test_continuous_batching_equals_one_at_a_time(tiny_bundle, tiny_model, gen, backend):
    cfg = tiny_model.cfg
    prompts = [random_ids(gen, 1, n, cfg.vocab_size)[0].tolist() for n in (19, 4, 11)]
    params = GenerationParams(max_new_tokens=10)
    expected = [generate(tiny_model, [p], 10)[0] for p in prompts]
    g = Generator(engines_for(backend, tiny_bundle, tiny_model), CacheManager(cfg, 2, 64))
    ids = [g.add(prompts[0], params)]
    for _ in range(3):
        g.step()
    ids.append(g.add(prompts[1], params))  # admitted while the first decodes
    g.step()
    ids.append(g.add(prompts[2], params))  # queued: both slots are busy
    assert g.requests[ids[2]].state == "waiting"
    done = g.run()
    assert [done[i].tokens for i in ids] == expected
    assert all(done[i].state == "finished" and done[i].finish_reason == "length" for i in ids)
    assert g.cache.free_slots == 2


def test_torch_backend_from_bundle_weights(tiny_bundle, tiny_model, gen):
    model = model_from_bundle(tiny_bundle)
    ids = random_ids(gen, 1, 12, tiny_model.cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(model(ids), tiny_model(ids))
    # every parameter, the routed experts (exported as [E, ...] stacks) row by row; only the
    # image-token router bias is read by no graph (zeroed)
    want = dict(tiny_model.named_parameters())
    differ = [name for name, p in model.named_parameters() if not torch.equal(p, want[name])]
    assert all(name.endswith("gate.bias_vl") for name in differ), differ
    assert any(".ffn.experts.7.w2." in name for name in want)


def test_a_bundle_naming_each_experts_weights_still_loads(tiny_bundle, tiny_model, tmp_path):
    """Bundles written before the export stacked the experts hold one initializer per expert
    weight (`layers.<i>.ffn.experts.<e>.w1.weight`); model_from_bundle loads those too."""
    import re
    import shutil

    import onnx
    from onnx import numpy_helper

    from dsflash.export.bundle import Bundle

    old = tmp_path / "per-expert"
    shutil.copytree(tiny_bundle.path, old)
    for path in old.glob("*.onnx"):
        proto = onnx.load(str(path))  # the weights inline, from the copy's weights.bin
        inits = []
        for init in proto.graph.initializer:
            m = re.fullmatch(r"(layers\.\d+\.ffn)\.routed_(w[123])", init.name)
            rows = enumerate(numpy_helper.to_array(init)) if m else ()
            inits += [numpy_helper.from_array(row, f"{m[1]}.experts.{e}.{m[2]}.weight")
                      for e, row in rows] if m else [init]
        del proto.graph.initializer[:]
        proto.graph.initializer.extend(inits)
        onnx.save(proto, str(path))
    model = model_from_bundle(Bundle.open(old, verify=False))
    want = dict(tiny_model.named_parameters())
    differ = [name for name, p in model.named_parameters() if not torch.equal(p, want[name])]
    assert all(name.endswith("gate.bias_vl") for name in differ), differ


def test_seeded_sampling_reproducible_and_topk1_greedy(tiny_bundle, tiny_model, gen):
    cfg = tiny_model.cfg
    prompt = random_ids(gen, 1, 9, cfg.vocab_size)[0].tolist()

    def run(sampling, n=12):
        g = Generator(engines_for("torch", tiny_bundle, tiny_model), CacheManager(cfg, 1, 64))
        rid = g.add(prompt, GenerationParams(sampling=sampling, max_new_tokens=n))
        return g.run()[rid].tokens

    s = SamplingParams(temperature=1.0, top_p=0.95, seed=5)
    assert run(s) == run(s)
    assert run(SamplingParams(temperature=0.8, top_k=1, seed=1)) == generate(tiny_model, [prompt], 12)[0]


def test_stop_tokens_strings_and_max_tokens(tiny_model, gen):
    cfg = tiny_model.cfg
    tok = ByteTokenizer(cfg.vocab_size)
    prompt = random_ids(gen, 1, 6, cfg.vocab_size)[0].tolist()
    free_run = generate(tiny_model, [prompt], 12)[0]
    engines = make_engines("torch", model=tiny_model)

    def run(**kw):
        g = Generator(engines, CacheManager(cfg, 1, 64), tokenizer=tok)
        rid = g.add(prompt, GenerationParams(max_new_tokens=12, **kw))
        return g.run()[rid]

    stop_at = 5
    r = run(stop_token_ids=(free_run[stop_at],))
    first = free_run.index(free_run[stop_at])
    assert r.tokens == free_run[:first + 1] and r.finish_reason == "stop_token"
    r = run()
    assert len(r.tokens) == 12 and r.finish_reason == "length"
    # stop at the first printable character the free run produces after its first token
    text = tok.decode(free_run)
    target = next((ch for ch in text[1:] if ch.isprintable() and ch.strip() and ch != "\ufffd"), None)
    assert target is not None, f"the free run decodes to no printable text: {text!r}"
    r = run(stop_strings=(target,))
    assert r.finish_reason == "stop_string" and target not in r.text
    assert len(r.tokens) < 12 and target in tok.decode(r.tokens)


def test_slot_reuse_leaks_no_state(tiny_bundle, tiny_model, gen):
    cfg = tiny_model.cfg
    long_prompt = random_ids(gen, 1, 40, cfg.vocab_size)[0].tolist()
    short = random_ids(gen, 1, 7, cfg.vocab_size)[0].tolist()
    params = GenerationParams(max_new_tokens=8)
    engines = engines_for("ort", tiny_bundle, tiny_model)
    g = Generator(engines, CacheManager(cfg, 1, 64))
    g.add(long_prompt, params)
    g.run()
    rid = g.add(short, params)
    reused = g.run()[rid].tokens
    fresh = Generator(engines, CacheManager(cfg, 1, 64))
    rid2 = fresh.add(short, params)
    assert reused == fresh.run()[rid2].tokens


def test_bytes_report_and_capacity_plan():
    flash = ModelConfig.preset("flash")
    cm = CacheManager(ModelConfig.preset("tiny"), 2, 32)
    assert cm.bytes_report()["allocated"] == cm.cache.nbytes()
    from dsflash.model.accounting import global_kv_bytes_per_token
    assert global_kv_bytes_per_token(flash) == 890
    budget, ctx = 64 * 2**30, 65536
    hand = budget // (3 * (ctx // 2) * 356 + ctx * 356 + 40 * 128 * 528 + 3 * 2 * 512 * 4 + 48)
    # tiny, released formats: entry 32/2 + 32/16 = 18 B, index key 16/2 + 16/32 = 8 B; sources
    # ratio 2 and 1; rings 8 layers x 8 slots x 33 B; one ratio-2 compressor state 2 x 32 x 4 B
    tiny_seq = (ctx // 2 + ctx) * 26 + 8 * 8 * 33 + 2 * 32 * 4 + 3 * 8 + 3 * 8
    assert cm.max_sequences(budget, ctx) == budget // tiny_seq
    from dsflash.model.accounting import max_sequences
    assert max_sequences(flash, budget, ctx) == hand == budget // sequence_bytes(flash, ctx)


def test_errors_are_clear(tiny_bundle, tiny_model):
    cfg = tiny_model.cfg
    g = Generator(engines_for("torch", tiny_bundle, tiny_model), CacheManager(cfg, 1, 16))
    with pytest.raises(ValueError, match="= 21 exceeds the cache capacity 16"):
        g.add(list(range(5)), GenerationParams(max_new_tokens=16))
    with pytest.raises(ValueError, match=r"token id 700 outside the vocabulary \[0, 512\)"):
        g.add([1, 700], GenerationParams())
    with pytest.raises(ValueError, match="unknown backend 'tensorflow'"):
        Runtime.from_bundle(tiny_bundle.path, backend="tensorflow")
    with pytest.raises(BundleError, match="not a bundle"):
        Runtime.from_bundle(tiny_bundle.path.parent, backend="ort")
    with pytest.raises(ValueError, match="compile_options are for the torch-compiled backend, not 'ort'"):
        Runtime.from_bundle(tiny_bundle.path, backend="ort", compile_options=TUNED_COMPILE)
    req = Request(0, [1], GenerationParams())
    with pytest.raises(RuntimeError, match="illegal transition waiting -> decoding"):
        req.advance("decoding")


def test_prompt_ids_are_checked_before_any_is_queued(tiny_bundle):
    rt = Runtime.from_bundle(tiny_bundle.path, backend="torch", slots=2, capacity=32)
    params = GenerationParams(max_new_tokens=2)
    with pytest.raises(TypeError, match=r"prompt\[1\]=1.5 must be an int, not float"):
        rt.generate([[3, 4], [2, 1.5]], params)
    with pytest.raises(TypeError, match=r"prompt\[0\]=tensor\(1.\) is not a token id"):
        rt.generate([torch.tensor([1, 2.0])], params)  # a float tensor's elements
    with pytest.raises(TypeError, match=r"prompt\[0\]=True must be an int, not bool"):
        rt.generate([[True, 2]], params)
    with pytest.raises(TypeError, match="a prompt of ids is a sequence of ints, not NoneType"):
        rt.generate([None], params)
    with pytest.raises(TypeError, match=r"takes a list of prompts: \[prompt\] for one"):
        rt.generate("hello", params)
    with pytest.raises(ValueError, match=r"token id 512 outside the vocabulary"):
        rt.generate([[3, 4], [512]], params)
    assert not rt.generator.has_unfinished()  # the good first prompts were not left queued
    ids = torch.tensor([5, 6, 7])
    [req] = rt.generate([ids], params)  # integer tensors and numpy ints are ids
    [same] = rt.generate([[5, 6, 7]], params)
    assert req.prompt == [5, 6, 7] and req.tokens == same.tokens and len(req.tokens) == 2


def test_more_requests_than_slots_all_finish(tiny_bundle, tiny_model, gen):
    cfg = tiny_model.cfg
    g = Generator(engines_for("torch", tiny_bundle, tiny_model), CacheManager(cfg, 2, 64))
    ids = [g.add(random_ids(gen, 1, 3 + i, cfg.vocab_size)[0].tolist(), GenerationParams(max_new_tokens=4))
           for i in range(5)]
    done = g.run()
    assert all(len(done[i].tokens) == 4 for i in ids)
    assert all(done[i].time_to_first_token is not None for i in ids)


class RecordingEngine:
    """An engine that records each call's ids shape and whether the state was read in place."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.input_names, self.output_names = engine.input_names, engine.output_names

    def run(self, feeds, resident=()):
        self.calls.append((tuple(feeds["ids"].shape), bool(resident)))
        return self.engine.run(feeds, resident=resident)


def test_warm_up_runs_the_served_steps_and_leaves_the_cache_alone(tiny_bundle, tiny_model, gen):
    """warm_up runs the decode step of every batch size on the lowest slots, in place, as decode
    batches do, and the replay prefill of each prompt length; the cache is untouched and what is
    generated afterwards equals a fresh generator's. Bad sizes name the value and the limit."""
    cfg = tiny_model.cfg
    w = cfg.sliding_window
    engines = {n: RecordingEngine(e) for n, e in engines_for("torch", tiny_bundle, tiny_model).items()}
    g = Generator(engines, CacheManager(cfg, 3, 64))
    before = {k: v.clone() for k, v in g.cache.cache.tensors.items()}
    seconds = g.warm_up(prompt_lengths=(5, w + 7))
    assert list(seconds) == ["prefill 5", f"prefill {w + 7}", "decode 1", "decode 2", "decode 3"]
    assert engines["encoder_prefill"].calls == [((1, 7), True)]
    assert engines["decoder_step"].calls == [((1, 5), True), ((1, w), True),
                                             ((1, 1), True), ((2, 1), True), ((3, 1), True)]
    assert all(torch.equal(before[k], v) for k, v in g.cache.cache.tensors.items())
    assert g.warm_up(batch_sizes=[2]).keys() == {"decode 2"}
    g.warm_up(batch_sizes=[], prompt_lengths=[w + 3], prefill_mode="exact")  # the whole prompt at once
    assert engines["decoder_step"].calls[-2:] == [((2, 1), True), ((1, w + 3), True)]
    assert len(engines["encoder_prefill"].calls) == 1
    prompts = [random_ids(gen, 1, n, cfg.vocab_size)[0].tolist() for n in (12, 4)]
    fresh = Generator(engines_for("torch", tiny_bundle, tiny_model), CacheManager(cfg, 3, 64))
    for gg in (g, fresh):
        for p in prompts:
            gg.add(p, GenerationParams(max_new_tokens=6))
    assert [r.tokens for r in g.run().values()] == [r.tokens for r in fresh.run().values()]
    with pytest.raises(ValueError, match=r"warm-up batch size 4 outside \[1, 3\] \(the cache's slots\)"):
        g.warm_up(batch_sizes=[1, 4])
    with pytest.raises(ValueError, match=r"warm-up prompt length 65 outside \[1, 64\]"):
        g.warm_up(prompt_lengths=[65])
    with pytest.raises(ValueError, match="prefill mode 'fast' is not 'replay' or 'exact'"):
        g.warm_up(prefill_mode="fast")
    g.add(prompts[0], GenerationParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="warm_up needs an idle generator: 1 waiting and 0 running"):
        g.warm_up()


def test_warm_up_on_the_kernels_starts_from_empty_slots(tiny_cfg):
    """The kernel engines' warm-up runs their steps on empty slots (no visible entries: on the
    GPU that is what compiles and captures), and what is generated afterwards equals the
    reference ops' tokens (Triton interpreter on the CPU, fp32)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
    model = DSFlashModel(tiny_cfg).init_weights(seed=3).eval()
    tokens = {}
    for backend in ("torch", "torch-triton"):
        g = Generator(make_engines(backend, model=model), CacheManager(tiny_cfg, 2, 32))
        if backend == "torch-triton":
            assert set(g.warm_up(prompt_lengths=[1])) == {"prefill 1", "decode 1", "decode 2"}
        rid = g.add([5], GenerationParams(max_new_tokens=3))
        tokens[backend] = g.run()[rid].tokens
    assert tokens["torch-triton"] == tokens["torch"]


def test_runtime_facade_streams_text(tiny_bundle):
    rt = Runtime.from_bundle(tiny_bundle.path, backend="ort", slots=2, capacity=64)
    events = list(rt.stream("hello", GenerationParams(max_new_tokens=6)))
    assert len(events) == 6 and events[-1].finished and not any(e.finished for e in events[:-1])
    [req] = rt.generate(["hello"], GenerationParams(max_new_tokens=6))
    assert req.tokens == [e.token for e in events]
    assert req.text == "".join(e.text for e in events)
    assert set(rt.warm_up(batch_sizes=[1, 2])) == {"decode 1", "decode 2"}


def test_cancel_frees_the_slot_and_an_abandoned_stream_cancels(tiny_bundle, tiny_model, gen):
    cfg = tiny_model.cfg
    g = Generator(engines_for("torch", tiny_bundle, tiny_model), CacheManager(cfg, 1, 64))
    params = GenerationParams(max_new_tokens=20)
    running = g.add([3, 4, 5], params)
    queued = g.add([6, 7], params)  # no second slot: it waits
    g.step()
    g.step()
    assert g.requests[running].state == "decoding" and g.requests[queued].state == "waiting"
    assert g.cancel(queued) and g.requests[queued].finish_reason == "cancelled"
    assert list(g.waiting) == []
    assert g.cancel(running) and g.cache.free_slots == 1 and not g.has_unfinished()
    assert len(g.requests[running].tokens) == 2 and not g.cancel(running)  # already finished
    with pytest.raises(RuntimeError, match="illegal transition finished -> prefill"):
        g.requests[running].advance("prefill")
    later = g.add([3, 4, 5], params)
    with pytest.raises(RuntimeError, match=f"request {later} is waiting: cancel it or let it finish"):
        g.forget(later)
    assert g.forget(running).request_id == running and running not in g.requests
    with pytest.raises(KeyError, match=f"no request {running} in this generator"):
        g.cancel(running)
    # the slot the cancelled request held serves the next one as a fresh sequence
    done = g.run()[later]
    fresh = Generator(engines_for("torch", tiny_bundle, tiny_model), CacheManager(cfg, 1, 64))
    again = fresh.add([3, 4, 5], params)
    assert done.tokens == fresh.run()[again].tokens

    rt = Runtime.from_bundle(tiny_bundle.path, backend="torch", slots=1, capacity=64)
    events = rt.stream([3, 4, 5], params)  # queued already, before the first next()
    assert rt.generator.has_unfinished()
    first = [next(events), next(events)]
    events.close()  # the caller stops reading: the request is cancelled and forgotten
    assert not rt.generator.has_unfinished() and not rt.generator.requests
    assert rt.generator.cache.free_slots == 1
    [req] = rt.generate([[3, 4, 5]], params)
    assert [e.token for e in first] == req.tokens[:2] and req.finish_reason == "length"
    assert not rt.generator.requests  # generate() hands its requests back and keeps none
    with pytest.raises(TypeError, match="a prompt of ids is a sequence of ints"):
        rt.stream(None, params)  # raised at the call, not at the first next()


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tiny_bundle, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models

    vocab = {f"w{i}": i for i in range(600)}  # the tiny model has 512 ids
    tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="has 600 ids, over the model's vocab_size 512"):
        Runtime.from_bundle(tiny_bundle.path, backend="ort", tokenizer=tmp_path / "tokenizer.json")


class FailingEngine:
    """An engine that raises on its `fail_at`-th call (counting from 1), as a backend error would."""

    def __init__(self, engine, fail_at: int):
        self.engine, self.fail_at, self.calls = engine, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run(self, feeds, resident=()):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("engine failure")
        return self.engine.run(feeds, resident=resident)


@pytest.mark.parametrize("fail_at", [1, 3])  # inside the first prefill; in a decode step
def test_an_engine_error_leaves_no_request_holding_a_slot(tiny_bundle, tiny_model, fail_at):
    engines = engines_for("torch", tiny_bundle, tiny_model)
    engines["decoder_step"] = FailingEngine(engines["decoder_step"], fail_at)
    rt = Runtime(Generator(engines, CacheManager(tiny_model.cfg, 2, 64)), "torch")
    params = GenerationParams(max_new_tokens=4)
    with pytest.raises(RuntimeError, match="engine failure"):
        rt.generate([[3, 4, 5], [6, 7]], params)
    assert not rt.generator.has_unfinished() and rt.generator.cache.free_slots == 2
    assert not rt.generator.requests
    [again] = rt.generate([[3, 4, 5]], params)  # the generator serves on
    assert again.finish_reason == "length" and len(again.tokens) == 4


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.slow
def test_long_generation_keeps_memory_flat(tiny_bundle, tiny_model):
    cfg = tiny_model.cfg
    g = Generator(make_engines("ort", bundle=tiny_bundle), CacheManager(cfg, 1, 2048))
    rid = g.add([5, 6, 7], GenerationParams(max_new_tokens=2000))
    allocated = g.cache.cache.nbytes()
    steps = g.stream()
    for _ in range(200):  # warm up allocator caches
        next(steps)
    base = rss_bytes()
    for _ in range(1500):
        next(steps)
    grown = rss_bytes() - base
    list(steps)
    assert len(g.requests[rid].tokens) == 2000
    assert g.cache.cache.nbytes() == allocated
    assert grown < 8 * 2**20, f"resident memory grew by {grown} bytes over 1500 decode steps"


def test_torch_engine_graphs_only_one_row_steps(tiny_model, gen):
    """With cuda_graph=True, decode steps (one row) go to the captured graphs and prefill chunks
    of any length run eagerly, so no graph is captured per prompt length. The routing is checked
    here with a recording stand-in for the graphs (capture itself needs CUDA: gpu tests)."""
    from dsflash.model.cache import ModelCache
    from dsflash.runtime.engine import TorchEngine

    engine = TorchEngine(tiny_model, "decoder_step")
    calls = []

    def recording(*tensors, resident=()):
        calls.append((tensors[0].shape[1], tuple(resident)))
        return engine.module(*tensors)

    engine._graphed = recording
    cache = ModelCache.allocate(tiny_model.cfg, 1, 32)
    state = cache.gather(cache.slot_index([0]))
    engine.run({"ids": random_ids(gen, 1, 3, tiny_model.cfg.vocab_size), **state})
    engine.run({"ids": random_ids(gen, 1, 1, tiny_model.cfg.vocab_size), **state})
    # resident inputs by name reach the graphs as positions in the contract's input order
    engine.run({"ids": random_ids(gen, 1, 1, tiny_model.cfg.vocab_size), **state},
               resident=["seq_len", "swa_kv"])
    at = engine.input_names.index
    assert calls == [(1, ()), (1, (at("swa_kv"), at("seq_len")))]


def test_generate_script_serves_and_says_bad_requests_in_one_line(tiny_bundle):
    script = Path(__file__).resolve().parents[1] / "scripts" / "generate.py"

    def run(*args):
        return subprocess.run([sys.executable, str(script), "--bundle", str(tiny_bundle.path),
                               "--backend", "torch", *args], capture_output=True, text=True, timeout=300,
                              check=False)

    ok = run("--prompt", "hi", "--max-new-tokens", "3", "--capacity", "32")
    assert ok.returncode == 0, ok.stderr
    assert "tokens=[" in ok.stdout and "finish=length" in ok.stdout and "3 tokens in" in ok.stdout
    over = run("--prompt", "hi", "--max-new-tokens", "40", "--capacity", "32")
    assert over.returncode == 2
    assert over.stderr.strip().splitlines() == [
        "generate.py: error: prompt of 2 tokens + max_new_tokens 40 = 42 exceeds the cache capacity 32"]
    missing = run("--prompt", "hi", "--bundle", str(tiny_bundle.path.parent / "nothing"))
    assert missing.returncode == 2 and "is not a bundle: manifest.json is missing" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_sessions_on_the_cuda_provider_run_without_memory_reuse(tiny_bundle):
    """onnxruntime-gpu 1.31.1 with memory reuse fails the portable decoder_step at a Where (a
    buffer reused too early; the CPU provider is right): sessions asking for CUDA turn reuse off,
    the others keep it. (CPU-only onnxruntime falls back to CPU, keeping the options.)"""
    import warnings

    from dsflash.export.ort_session import cuda_providers, ort_session

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDAExecutionProvider is not available" without a GPU
        on_cuda = ort_session(tiny_bundle, "decoder_step", "portable", cuda_providers())
    assert on_cuda.get_session_options().enable_mem_reuse is False
    on_cpu = ort_session(tiny_bundle, "decoder_step", "portable")
    assert on_cpu.get_session_options().enable_mem_reuse is True


def test_an_onnx_engine_refuses_inputs_of_another_dtype_naming_them(tiny_bundle):
    """A bf16 cache fed to a float32 bundle's graph (or int32 ids) is refused before ONNX Runtime
    runs, naming the input, its dtype and the graph's."""
    engine = make_engines("ort", bundle=tiny_bundle)["decoder_step"]
    cm = CacheManager(tiny_bundle.config, 1, 16, dtype=torch.bfloat16)
    cm.acquire()
    feeds = cm.feeds([0], engine.input_names, torch.tensor([[3]]))
    wrong = "swa_kv is torch.bfloat16, but this bundle's graph takes torch.float32"
    with pytest.raises(ValueError, match=wrong):
        engine.run(feeds)
    cm = CacheManager(tiny_bundle.config, 1, 16)
    cm.acquire()
    feeds = cm.feeds([0], engine.input_names, torch.tensor([[3]], dtype=torch.int32))
    with pytest.raises(ValueError, match="input ids is torch.int32"):
        engine.run(feeds)
    feeds["ids"] = feeds["ids"].long()
    assert engine.run(feeds)["logits"].shape == (1, tiny_bundle.config.vocab_size)


def test_the_ort_cuda_backend_refuses_to_serve_from_the_cpu(tiny_bundle):
    """Without onnxruntime-gpu (or a GPU) ONNX Runtime would quietly run "ort-cuda" on the CPU;
    the engines refuse instead, naming the providers it did enable."""
    import warnings

    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("the CUDA provider is available here (tests/test_ort_cuda.py uses it)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # onnxruntime's own "not in available provider names"
        with pytest.raises(RuntimeError, match=r"did not enable the CUDA provider \(enabled: \['CPU"):
            make_engines("ort-cuda", bundle=tiny_bundle)
