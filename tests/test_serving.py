"""ServingLoop: requests from many threads share decode batches; handles stream, cancel, fail."""

import threading

import pytest

from dsflash.runtime.api import Runtime
from dsflash.runtime.cache_manager import CacheManager
from dsflash.runtime.engine import make_engines
from dsflash.runtime.generator import Generator
from dsflash.runtime.request import GenerationParams
from dsflash.runtime.serving import ServingLoop

from conftest import submit_from_threads

PROMPTS = [[3, 4, 5], [9, 8], [100, 200, 300, 400], [7]]


class RecordingEngine:
    """Forwards to an engine; records each call's batch size; the first call waits for `gate`."""

    def __init__(self, engine, gate: threading.Event, fail_at: int = 0):
        self.engine, self.gate, self.fail_at = engine, gate, fail_at
        self.batches: list[int] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def run(self, feeds, resident=()):
        assert self.gate.wait(60), "the test never opened the gate"
        self.batches.append(int(feeds["ids"].shape[0]))
        if len(self.batches) == self.fail_at:
            raise RuntimeError("engine failure")
        return self.engine.run(feeds, resident=resident)


def serving_runtime(bundle, model, slots=4, fail_at=0):
    gate = threading.Event()
    engines = make_engines("torch", bundle=bundle, model=model)
    engines["decoder_step"] = recorder = RecordingEngine(engines["decoder_step"], gate, fail_at)
    rt = Runtime(Generator(engines, CacheManager(model.cfg, slots, 64)), "torch")
    return rt, gate, recorder


def test_threads_share_decode_batches_and_get_their_own_tokens(tiny_bundle, tiny_model):
    params = GenerationParams(max_new_tokens=6)
    alone = Runtime(Generator(make_engines("torch", bundle=tiny_bundle, model=tiny_model),
                              CacheManager(tiny_model.cfg, 1, 64)), "torch")
    expected = [alone.generate([p], params)[0].tokens for p in PROMPTS]

    rt, gate, recorder = serving_runtime(tiny_bundle, tiny_model)
    with ServingLoop(rt) as loop:
        handles = submit_from_threads(loop, PROMPTS, params)
        gate.set()  # every request is queued before the first step runs
        done = [h.result(timeout=120) for h in handles]
        streamed = [[e.token for e in h] for h in handles]
    assert [r.tokens for r in done] == expected == streamed
    assert all(r.finish_reason == "length" for r in done)
    assert max(recorder.batches) == len(PROMPTS)  # the four threads' requests decoded together
    assert not rt.generator.requests and rt.generator.cache.free_slots == 4


def test_cancel_bad_input_engine_error_and_close(tiny_bundle, tiny_model):
    rt, gate, _ = serving_runtime(tiny_bundle, tiny_model, slots=2, fail_at=0)
    gate.set()
    loop = ServingLoop(rt)
    with pytest.raises(ValueError, match=r"token id 512 outside the vocabulary \[0, 512\)"):
        loop.submit([1, 512])  # raised in the caller's thread, nothing queued
    handle = loop.submit([3, 4, 5], GenerationParams(max_new_tokens=50))
    events = iter(handle)
    first = [next(events), next(events)]
    assert handle.cancel()
    req = handle.result(timeout=60)
    assert not handle.cancel()  # finished: nothing to cancel
    assert req.finish_reason == "cancelled" and req.tokens[:2] == [e.token for e in first]
    assert 2 <= len(req.tokens) < 50
    rest = list(handle)  # the events put before the cancel, then the end
    assert [e.token for e in first + rest] == req.tokens and list(handle) == []
    loop.close()
    with pytest.raises(RuntimeError, match="the serving loop is closed"):
        loop.submit([3])
    assert not loop._thread.is_alive() and rt.generator.cache.free_slots == 2

    # an engine error reaches every waiting caller; the loop serves the next request
    rt, gate, _ = serving_runtime(tiny_bundle, tiny_model, slots=2, fail_at=3)
    with ServingLoop(rt) as loop:
        handles = [loop.submit(p, GenerationParams(max_new_tokens=4)) for p in PROMPTS[:2]]
        gate.set()
        for h in handles:
            with pytest.raises(RuntimeError, match="engine failure"):
                h.result(timeout=60)
            with pytest.raises(RuntimeError, match="engine failure"):
                list(h)
        again = loop.submit(PROMPTS[0], GenerationParams(max_new_tokens=4)).result(timeout=60)
        assert again.finish_reason == "length" and len(again.tokens) == 4
    rt, gate, _ = serving_runtime(tiny_bundle, tiny_model)
    with ServingLoop(rt) as loop:
        handle = loop.submit([3], GenerationParams(max_new_tokens=2))
        with pytest.raises(TimeoutError, match=r"request (0|not yet admitted) unfinished after 0.01 s"):
            handle.result(timeout=0.01)  # the step waits on the closed gate
        assert not handle.done()
        gate.set()
        assert handle.result(timeout=60).finish_reason == "length"


def test_a_loop_that_stops_on_a_bug_fails_its_callers_instead_of_hanging(tiny_bundle, tiny_model):
    rt, gate, _ = serving_runtime(tiny_bundle, tiny_model)
    gate.set()

    def broken_add(prompt, params):
        raise KeyError("a bug in admission")

    rt.generator.add = broken_add  # on the loop thread, after submit's checks passed
    loop = ServingLoop(rt)
    handle = loop.submit([3, 4], GenerationParams(max_new_tokens=2))
    with pytest.raises(KeyError, match="a bug in admission"):
        handle.result(timeout=60)
    loop._thread.join(60)
    assert not loop._thread.is_alive()
    with pytest.raises(RuntimeError, match="the serving loop stopped: KeyError"):
        loop.submit([3])
    loop.close()  # closing a stopped loop is quiet
