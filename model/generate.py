"""A simple generate loop over the reference model (for the demo and as an oracle).

The serving loop with batching and streaming lives in dsflash.runtime; this one prefills each
prompt into its own slot, then decodes all prompts together. Sampling: model/sampling.py.
"""

from __future__ import annotations

import torch

from dsflash.model.cache import ModelCache
from dsflash.model.sampling import SamplingParams, sample_next


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
