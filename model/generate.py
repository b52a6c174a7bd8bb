"""Sampling and a simple generate loop over the reference model (for the demo and as an oracle).

The serving loop with batching and streaming lives in dsflash.runtime; this one prefills each
prompt into its own slot, then decodes all prompts together.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from dsflash.model.cache import ModelCache
from dsflash.model.dtypes import f32


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # NaN too: softmax would sample garbage
            raise ValueError(f"temperature={self.temperature} must be finite and >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample_next(logits_BV: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> torch.Tensor:
    """One token per row. Greedy takes the lowest id among equal maxima (argmax's rule)."""
    if params.greedy:
        return logits_BV.argmax(-1)
    scores = f32(logits_BV) / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = torch.softmax(sorted_scores, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits_BV.device)


def select_tokens(logits_BV: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> list[int]:
    """One token per row, row i picked by params[i] with generators[i], the token sample_next
    picks from that row copied to the host, with less copied: greedy rows take their argmax where
    the logits are (the argmax of bf16 / fp16 logits is that of their exact fp32 copy, the lowest
    id among equal maxima on every device) and only their ids come to the host; the sampled rows
    come to the host in fp32, in one copy, and are sampled there with their CPU generators. A
    decode batch of greedy rows then copies 8 bytes per row instead of the vocab's logits (flash's
    129,280 fp32 logits: 0.5 MB per row)."""
    rows = logits_BV.shape[0] if logits_BV.dim() == 2 else None
    if rows is None or len(params) != rows or len(generators) != rows:
        raise ValueError(f"select_tokens: logits {tuple(logits_BV.shape)} must be [rows, vocab] with "
                         f"one params and one generator per row; got {len(params)} params and "
                         f"{len(generators)} generators")
    tokens = [0] * rows
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if greedy:
        picked = logits_BV
        if len(greedy) < rows:
            picked = logits_BV[torch.tensor(greedy, device=logits_BV.device)]
        for i, tok in zip(greedy, picked.argmax(-1).tolist()):
            tokens[i] = tok
    if sampled:
        host = logits_BV[torch.tensor(sampled, device=logits_BV.device)].detach().float().cpu()
        for j, i in enumerate(sampled):
            tokens[i] = int(sample_next(host[j:j + 1], params[i], generators[i])[0])
    return tokens


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int,
             params: SamplingParams = SamplingParams(), mode: str = "replay",
             eos_token_id: int | None = None) -> list[list[int]]:
    """New tokens for each prompt (stops a row at eos; the batch decodes until all stop)."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be > 0")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = model.embed.weight.device
    capacity = max(len(p) for p in prompts) + max_new_tokens
    cache = ModelCache.allocate(model.cfg, len(prompts), capacity, device, model.embed.weight.dtype)
    gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    last = []
    for slot, prompt in enumerate(prompts):
        last.append(model.prefill(torch.tensor([prompt], device=device), cache, [slot], mode=mode))
    logits = torch.cat(last)
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in range(max_new_tokens):
        tok = sample_next(logits, params, gen)
        for i, t in enumerate(tok.tolist()):
            if not done[i]:
                out[i].append(t)
                done[i] = eos_token_id is not None and t == eos_token_id
        if all(done) or step == max_new_tokens - 1:
            break
        logits = model.decoder_step(tok.unsqueeze(1), cache)
    return out
