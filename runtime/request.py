"""A request and its state machine: waiting -> prefill -> decoding -> finished (PIPELINE.md §5)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dsflash.model.config_checks import positive_int
from dsflash.model.generate import SamplingParams
from dsflash.model.model import check_prefill_mode

# waiting -> finished: a request cancelled before it had a slot
TRANSITIONS = {"waiting": ("prefill", "finished"), "prefill": ("decoding", "finished"),
               "decoding": ("finished",), "finished": ()}


@dataclass(frozen=True)
class GenerationParams:
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 32
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    prefill_mode: str = "replay"

    def __post_init__(self) -> None:
        positive_int("max_new_tokens", self.max_new_tokens)
        check_prefill_mode(self.prefill_mode)


@dataclass
class Request:
    request_id: int
    prompt: list[int]
    params: GenerationParams
    state: str = "waiting"
    slot: int | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first_token: float | None = None
    t_finished: float | None = None

    def advance(self, new_state: str) -> None:
        if new_state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.state} -> {new_state}")
        self.state = new_state
        if new_state == "finished":
            self.t_finished = time.perf_counter()

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.t_first_token is None else self.t_first_token - self.t_arrival

    @property
    def time_per_output_token(self) -> float | None:
        if self.t_finished is None or self.t_first_token is None or len(self.tokens) < 2:
            return None
        return (self.t_finished - self.t_first_token) / (len(self.tokens) - 1)
