"""The embeddable facade:

    rt = Runtime.from_bundle("engines/tiny", backend="ort")
    # backends: torch, torch-triton (kernels; CUDA graphs on a GPU), torch-compiled (the same,
    # the decode step compiled by torch.compile first), ort, ort-plugin,
    # ort-cuda (onnxruntime-gpu, IOBinding), trt (plans built by scripts/build_engines.py)
    texts = rt.generate(["hello"], GenerationParams(max_new_tokens=16))
    for event in rt.stream("hello", GenerationParams()): ...
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from dsflash.export.bundle import Bundle
from dsflash.runtime.cache_manager import CacheManager
from dsflash.runtime.engine import BACKENDS, TORCH_BACKENDS, make_engines
from dsflash.runtime.generator import Generator, TokenEvent, token_ids
from dsflash.runtime.request import GenerationParams, Request
from dsflash.runtime.tokenizer import ByteTokenizer, HFTokenizer


class Runtime:
    def __init__(self, generator: Generator, backend: str):
        self.generator, self.backend = generator, backend
        self.tokenizer = generator.tokenizer

    @classmethod
    def from_bundle(cls, path: str | Path, backend: str = "ort", slots: int = 4, capacity: int = 512,
                    tokenizer: str | Path | None = None, compile_options: Mapping | None = None
                    ) -> Runtime:
        """compile_options: inductor settings for torch-compiled (e.g. engine.TUNED_COMPILE)."""
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; backends: {BACKENDS}")
        bundle = Bundle.open(path)
        model = None
        # GPU backends keep the cache on the GPU (IOBinding / plan addresses / CUDA graphs)
        kernels = backend in ("torch-triton", "torch-compiled")
        on_gpu = backend in ("ort-cuda", "trt") or (kernels and torch.cuda.is_available())
        device = "cuda" if on_gpu else "cpu"
        if backend in TORCH_BACKENDS:
            from dsflash.runtime.weights import model_from_bundle

            model = model_from_bundle(bundle).to(device)
        engines = make_engines(backend, bundle=bundle, model=model, compile_options=compile_options)
        tok = HFTokenizer(tokenizer) if tokenizer else ByteTokenizer(bundle.config.vocab_size)
        if tok.vocab_size > bundle.config.vocab_size:
            # a smaller vocabulary is usual (padded embeddings); a larger one yields ids the model lacks
            raise ValueError(f"tokenizer {tokenizer} has {tok.vocab_size} ids, over the model's "
                             f"vocab_size {bundle.config.vocab_size}")
        cache = CacheManager(bundle.config, slots, capacity, device=device, dtype=bundle.dtype)
        return cls(Generator(engines, cache, tok), backend)

    def warm_up(self, batch_sizes=None, prompt_lengths=(), prefill_mode: str = "replay") -> dict[str, float]:
        """Compile and capture what serving will need before the first request (Generator.warm_up):
        call it once after from_bundle; -> seconds per warmed step."""
        return self.generator.warm_up(batch_sizes, prompt_lengths, prefill_mode)

    def encode(self, prompt) -> list[int]:
        """Text through the tokenizer; a sequence of ids as it is (Generator.add checks it)."""
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else token_ids(prompt)

    def generate(self, prompts: list, params: GenerationParams = GenerationParams()) -> list[Request]:
        """Serve a list of prompts (text or ids) to the end; -> their requests in order. Every
        prompt is checked before any is queued, so one bad prompt leaves nothing behind."""
        if isinstance(prompts, (str, bytes)):
            raise TypeError("Runtime.generate takes a list of prompts: [prompt] for one, or stream()")
        encoded = [self.generator.check_request(self.encode(p), params) for p in prompts]
        ids = [self.generator.add(p, params) for p in encoded]
        try:
            self.generator.run()
        finally:  # an engine error leaves none of these requests queued, kept or holding a slot
            for rid in ids:
                self.generator.cancel(rid)
            done = [self.generator.forget(rid) for rid in ids]
        return done

    def stream(self, prompt, params: GenerationParams = GenerationParams()) -> Iterator[TokenEvent]:
        """The tokens of one prompt as they come. The prompt is checked and queued here, before
        the first next(); leaving the loop early (break, close(), an exception) cancels the
        request and frees its slot. Each next() runs generator steps for every running request;
        the events of other requests go to no one, so serve one stream or generate() at a time
        (a generate() between two next() finishes this request too, and the stream then ends)."""
        rid = self.generator.add(self.encode(prompt), params)
        return self._events(rid)

    def _events(self, rid: int) -> Iterator[TokenEvent]:
        req = self.generator.requests[rid]
        try:
            # its state, not its last event, ends the loop: a request cancelled from elsewhere
            # has no last event
            while req.state != "finished":
                for event in self.generator.step():
                    if event.request_id == rid:
                        yield event
        finally:
            self.generator.cancel(rid)
            self.generator.forget(rid)
