"""A request and its state machine: waiting -> prefill -> decoding -> finished (PIPELINE.md §5)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from dsflash.model.config_checks import positive_int, whole_number
from dsflash.model.model import check_prefill_mode
from dsflash.model.sampling import SamplingParams

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
        # a bare str would be taken as one stop string per character, a bare int would fail
        # mid-generation: both are refused here, and lists become the frozen tuples they stand for
        if isinstance(self.stop_strings, (str, bytes)) or not all(
                isinstance(s, str) and s for s in self.stop_strings):
            raise TypeError(f"stop_strings={self.stop_strings!r} must be a sequence of non-empty str")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError(f"stop_token_ids={self.stop_token_ids!r} must be a sequence of token ids")
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        object.__setattr__(self, "stop_token_ids",
                           tuple(whole_number("stop_token_ids[]", t) for t in self.stop_token_ids))
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
