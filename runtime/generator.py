"""Generator: continuous batching over the two graphs (PIPELINE.md §5).

Each `step()`: admit waiting requests into free slots and prefill them one at a time (replay:
encoder_prefill on all but the last W prompt rows, then decoder_step on the tail; or exact), which
yields each one's first token; then decode every running request in one batch (ragged lengths:
each slot has its own seq_len). Tokens stream out as events; a request finishes on a stop token,
a stop string or max_new_tokens, and its slot is freed at once. Running sequences are kept in the
lowest slots (a sequence above a freed slot moves down once), so a decode batch is one run of
slots whose state the engines read in place.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dsflash.model.config_checks import whole_number
from dsflash.model.model import check_prefill_mode, encoder_rows
from dsflash.model.sampling import select_tokens
from dsflash.runtime.cache_manager import CacheManager
from dsflash.runtime.request import GenerationParams, Request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenEvent:
    request_id: int
    token: int
    text: str            # decoded text this token adds ("" without a tokenizer)
    finished: bool
    finish_reason: str | None = None


def token_ids(prompt) -> list[int]:
    """A prompt's ids as Python ints; a float, bool or string id raises (int() would truncate 1.5
    to 1 and serve a prompt the caller never sent)."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise TypeError(f"a prompt of ids is a sequence of ints, not {type(prompt).__name__}")
    ids = []
    for pos, tok in enumerate(prompt):
        try:  # operator.index: ints, numpy integers, one-element integer tensors
            ids.append(operator.index(whole_number(f"prompt[{pos}]", tok)))
        except TypeError as err:
            if str(err).startswith("prompt["):
                raise
            raise TypeError(f"prompt[{pos}]={tok!r} is not a token id: {err}") from None
    return ids


class Generator:
    def __init__(self, engines: dict, cache: CacheManager, tokenizer=None, prefills_per_step: int = 1):
        self.engines, self.cache, self.tokenizer = engines, cache, tokenizer
        self.cfg = cache.cfg
        self.prefills_per_step = prefills_per_step
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._rngs: dict[int, torch.Generator | None] = {}

    # ------------------------------------------------------------------ requests
    def add(self, prompt: list[int], params: GenerationParams = GenerationParams()) -> int:
        """Queue one request; -> its id. Raises before queueing anything (check_request)."""
        prompt = self.check_request(prompt, params)
        req = Request(next(self._ids), prompt, params)
        seed = params.sampling.seed
        self._rngs[req.request_id] = torch.Generator().manual_seed(seed) if seed is not None else None
        self.requests[req.request_id] = req
        self.waiting.append(req)
        return req.request_id

    def check_request(self, prompt, params: GenerationParams) -> list[int]:
        """The prompt's ids if this generator can serve it with `params`; else ValueError / TypeError
        naming the value and the limit."""
        prompt = token_ids(prompt)
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})")
        need = len(prompt) + params.max_new_tokens
        if need > self.cache.capacity:
            raise ValueError(f"prompt of {len(prompt)} tokens + max_new_tokens {params.max_new_tokens} "
                             f"= {need} exceeds the cache capacity {self.cache.capacity}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        return prompt

    def cancel(self, request_id: int) -> bool:
        """Finish a waiting or running request now (finish_reason "cancelled"), freeing its slot
        for the next step; -> False if it had already finished. Between steps only: the loop is
        not thread-safe."""
        req = self._known(request_id)
        if req.state == "finished":
            return False
        if req.state == "waiting":
            self.waiting.remove(req)
        else:  # decoding, or prefill when an engine raised inside _prefill (not yet running)
            self.running.pop(request_id, None)
            self.cache.release(req.slot)
        req.advance("finished")
        req.finish_reason = "cancelled"
        log.debug("request %d cancelled after %d tokens", request_id, len(req.tokens))
        return True

    def forget(self, request_id: int) -> Request:
        """Drop a finished request from `requests` (a long-running service would otherwise keep
        every request it ever served); -> the request."""
        req = self._known(request_id)
        if req.state != "finished":
            raise RuntimeError(f"request {request_id} is {req.state}: cancel it or let it finish "
                               "before forgetting it")
        self._rngs.pop(request_id, None)
        return self.requests.pop(request_id)

    def _known(self, request_id: int) -> Request:
        if request_id not in self.requests:
            raise KeyError(f"no request {request_id} in this generator (finished and forgotten, "
                           "or never added)")
        return self.requests[request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def warm_up(self, batch_sizes=None, prompt_lengths=(), prefill_mode: str = "replay") -> dict[str, float]:
        """Run the steps that traffic will need before it arrives, so that no request waits on
        a compile or a capture: the decode step for each batch size (default: 1 to every slot),
        on the lowest slots as the decode batches use them (torch-compiled compiles its two
        graphs, 1-4 minutes for the small preset on the H200; graphed backends capture one CUDA
        graph per size), and the prefill of each prompt length in `prompt_lengths` as
        `prefill_mode` runs it (eager: Triton compiles its kernels for those shapes). Nothing is
        written to the cache; the generator must be idle. -> seconds per warmed step, by name
        ("decode 4", "prefill 300")."""
        if self.has_unfinished():
            raise RuntimeError(f"warm_up needs an idle generator: {len(self.waiting)} waiting and "
                               f"{len(self.running)} running requests")
        slots = self.cache.slots
        sizes = range(1, slots + 1) if batch_sizes is None else [int(b) for b in batch_sizes]
        for b in sizes:
            if not 1 <= b <= slots:
                raise ValueError(f"warm-up batch size {b} outside [1, {slots}] (the cache's slots)")
        check_prefill_mode(prefill_mode)
        for n in prompt_lengths:
            if not 1 <= int(n) <= self.cache.capacity:
                raise ValueError(f"warm-up prompt length {n} outside [1, {self.cache.capacity}] "
                                 "(the cache capacity)")
        seconds = {}
        for n in (int(n) for n in prompt_lengths):  # as _prefill splits the prompt
            t0 = time.perf_counter()
            split = encoder_rows(self.cfg, n, prefill_mode)
            if split:
                self._run("encoder_prefill", [0], torch.zeros(1, split, dtype=torch.int64))
            self._run("decoder_step", [0], torch.zeros(1, n - split, dtype=torch.int64))
            seconds[f"prefill {n}"] = time.perf_counter() - t0
        for b in sizes:
            t0 = time.perf_counter()
            outputs, _ = self._run("decoder_step", list(range(b)), torch.zeros(b, 1, dtype=torch.int64))
            outputs["logits"].argmax(-1).cpu()  # as _decode's greedy rows: waits for the step
            seconds[f"decode {b}"] = time.perf_counter() - t0
            log.info("warm-up: decode step of %d sequences in %.2f s", b, seconds[f"decode {b}"])
        return seconds

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        self._compact()
        admitted = 0
        while self.waiting and self.cache.free_slots and admitted < self.prefills_per_step:
            req = self.waiting.popleft()
            events.append(self._prefill(req))
            admitted += 1
        admitted_ids = {e.request_id for e in events}
        batch = sorted((r for r in self.running.values() if r.state == "decoding"
                        and r.request_id not in admitted_ids), key=lambda r: r.slot)
        if batch:
            events += self._decode(batch)
        return events

    def stream(self) -> Iterator[TokenEvent]:
        while self.has_unfinished():
            yield from self.step()

    def run(self) -> dict[int, Request]:
        for _ in self.stream():
            pass
        return self.requests

    # ------------------------------------------------------------------ graph calls
    def _compact(self) -> None:
        """Keep the running sequences in the lowest slots: while a free slot lies below the
        highest running one, move that sequence down (its state is copied once). A decode batch
        is then one run of slots, which the cache feeds as views, so steps copy no state."""
        while self.running:
            top = max(self.running.values(), key=lambda r: r.slot)
            low = self.cache.lowest_free()
            if low is None or low > top.slot:
                return
            self.cache.move(top.slot, low)
            log.debug("request %d moved from slot %d to %d", top.request_id, top.slot, low)
            top.slot = low

    def _run(self, graph: str, slots: list[int], ids: torch.Tensor) -> tuple[dict, dict]:
        """One engine call on the slots' state (read in place where the slots are one run)."""
        engine = self.engines[graph]
        feeds = self.cache.feeds(slots, engine.input_names, ids)
        resident = [n for n in engine.input_names if n != "ids"] if self.cache.in_place(slots) else ()
        return engine.run(feeds, resident=resident), feeds

    def _call(self, graph: str, slots: list[int], ids: torch.Tensor) -> dict:
        outputs, feeds = self._run(graph, slots, ids)
        self.cache.write(graph, slots, outputs, feeds["seq_len"])
        return outputs

    def _prefill(self, req: Request) -> TokenEvent:
        req.slot = self.cache.acquire()
        req.advance("prefill")
        ids = torch.tensor([req.prompt], dtype=torch.int64)
        split = encoder_rows(self.cfg, len(req.prompt), req.params.prefill_mode)
        if split:
            self._call("encoder_prefill", [req.slot], ids[:, :split])
        logits = self._call("decoder_step", [req.slot], ids[:, split:])["logits"]
        self.running[req.request_id] = req
        return self._accept(req, self._select([req], logits[:1])[0])

    def _decode(self, batch: list[Request]) -> list[TokenEvent]:
        ids = torch.tensor([[r.tokens[-1]] for r in batch], dtype=torch.int64)
        logits = self._call("decoder_step", [r.slot for r in batch], ids)["logits"]
        return [self._accept(r, tok) for r, tok in zip(batch, self._select(batch, logits))]

    def _select(self, batch: list[Request], logits_BV: torch.Tensor) -> list[int]:
        """The batch's next tokens: greedy rows by argmax on the engine's device, sampled rows on the
        host with each request's seeded CPU generator (model/sampling.py:select_tokens)."""
        return select_tokens(logits_BV, [r.params.sampling for r in batch],
                             [self._rngs[r.request_id] for r in batch])

    def _accept(self, req: Request, tok: int) -> TokenEvent:
        if req.t_first_token is None:
            req.t_first_token = time.perf_counter()
        req.tokens.append(tok)
        delta = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.tokens)
            delta, req.text = text[len(req.text):], text
        reason = self._finish_reason(req, tok)
        if req.state == "prefill":
            req.advance("decoding" if reason is None else "finished")
        elif reason is not None:
            req.advance("finished")
        if reason is not None:
            req.finish_reason = reason
            self.running.pop(req.request_id)
            self.cache.release(req.slot)
            log.debug("request %d finished (%s) after %d tokens", req.request_id, reason, len(req.tokens))
        return TokenEvent(req.request_id, tok, delta, reason is not None, reason)

    def _finish_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids:
            return "stop_token"
        for s in p.stop_strings:
            at = req.text.find(s)
            if at >= 0:
                req.text = req.text[:at]
                return "stop_string"
        if len(req.tokens) >= p.max_new_tokens:
            return "length"
        return None
