"""Token sampling: greedy, temperature, top-k and top-p (nucleus), seeded per request.

What a sampled row may draw, with which probabilities, is defined by `candidates_reference`
(it sorts the whole vocabulary: the spec). `candidates` returns the same without that sort
(10-15 ms at 129,280 tokens on a 2-core CPU): top-k through torch.topk, top-p by sorting only the
binades (powers of two) of probability that hold the nucleus. `sample_next` draws by the inverse
CDF of one fp64 uniform from the request's generator over `candidates` in its order (id order
without top-p; probability desc, id asc with it), so a draw costs one random number whatever the
vocabulary (torch.multinomial, used before 2026-12-06, drew one exponential per token).
Everything past the logits runs on the host in fp32 / fp64: a seed gives the same token from the
same logits whichever engine produced them.

Ties are broken the same way everywhere: top-k keeps every token whose score equals the k-th
largest (it may keep more than k), and top-p orders equal probabilities by ascending id.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from dsflash.model.dtypes import f32

FP32_MANTISSA_BITS, FP32_EXPONENTS = 23, 256  # an fp32's bits >> 23: its biased exponent


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


def _scores(logits_V: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, bool]:
    """The row's logits / temperature in fp32 on the host, and whether any is -inf (masked).
    One pass checks them: NaN or +inf would sample garbage (softmax of them is NaN)."""
    if logits_V.dim() != 1 or logits_V.numel() == 0:
        raise ValueError(f"one row of logits [vocab] expected, got shape {tuple(logits_V.shape)}")
    row = f32(logits_V).cpu()
    low, high = (float(v) for v in torch.aminmax(row))
    if math.isnan(high) or high == math.inf:
        bad = int((torch.isnan(row) | (row == math.inf)).nonzero()[0])
        raise ValueError(f"cannot sample from logits with NaN or +inf at id {bad} (vocab {row.numel()})")
    if high == -math.inf:
        raise ValueError(f"cannot sample from logits with every logit -inf (vocab {row.numel()})")
    scores = row / params.temperature
    if float(scores.max()) == math.inf:
        raise ValueError(f"temperature={params.temperature} overflows the logits (max {high}) to +inf")
    return scores, low == -math.inf


def _kept(scores_V: torch.Tensor, kth: float | None, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids top-k keeps (every finite score >= the k-th largest, kth; None: every finite one),
    in id order, and their probabilities: the softmax of their scores alone. A -inf logit (a
    masked token) is never kept, also where fewer than k tokens are finite (kth = -inf)."""
    if kth is not None:
        kept = scores_V >= kth
        ids = torch.nonzero(kept & (scores_V > -math.inf) if masked else kept).squeeze(1)
    elif masked:
        ids = torch.nonzero(scores_V > -math.inf).squeeze(1)
    else:  # every token: no gather
        return torch.arange(scores_V.numel()), torch.softmax(scores_V, dim=0)
    return ids, torch.softmax(scores_V[ids], dim=0)


def _nucleus(ids_N: torch.Tensor, probs_N: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens kept by top-p among candidates already sorted by (probability desc, id asc): a
    token goes when the mass before it reaches top_p (the first always stays). The mass before is
    the running sum shifted by one, not running sum - probability: that one rounds, and can fall
    below top_p again after a token that reached it."""
    before = torch.cat([probs_N.new_zeros(1), probs_N.cumsum(0)[:-1]])
    keep = before < top_p
    return ids_N[keep], probs_N[keep]


def _sorted_desc(ids_N: torch.Tensor, probs_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted by (probability desc, id asc): ids_N come in ascending order and the sort is stable."""
    order = torch.argsort(-probs_N, stable=True)
    return ids_N[order], probs_N[order]


def candidates_reference(logits_V: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec of a sampled row: the ids a non-greedy request may draw and their probabilities
    (the softmax of the scores top-k keeps, before top-p cuts), sorted by (probability desc, id
    asc). Sorts the whole vocabulary: slow at a large vocabulary."""
    scores, masked = _scores(logits_V, params)
    kth = None
    if params.top_k and params.top_k < scores.numel():
        kth = float(torch.sort(scores, descending=True).values[params.top_k - 1])
    ids, probs = _sorted_desc(*_kept(scores, kth, masked))
    if params.top_p < 1.0:
        ids, probs = _nucleus(ids, probs, params.top_p)
    return ids, probs


def _nucleus_binade(exponent_N: torch.Tensor, probs_N: torch.Tensor, top_p: float) -> int:
    """The highest biased exponent e whose tokens with exponent >= e hold top_p of the mass (fp64
    histogram of the mass per exponent); 0 when none does."""
    mass = torch.bincount(exponent_N, weights=probs_N.double(), minlength=FP32_EXPONENTS)
    from_top = mass.flip(0).cumsum(0).flip(0)  # [e]: the mass of every token in binade e or above
    reached = torch.nonzero(from_top >= top_p).squeeze(1)
    return int(reached[-1]) if reached.numel() else 0


def _top_p_candidates(ids_N: torch.Tensor, probs_N: torch.Tensor,
                      top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """_sorted_desc then _nucleus, sorting only the tokens of the highest binades (powers of two
    of the probability) that hold top_p of the mass: one pass makes a histogram of the mass per
    binade, and the tokens at or above the binade where that mass reaches top_p are sorted."""
    exponent = probs_N.view(torch.int32) >> FP32_MANTISSA_BITS  # probabilities are >= 0: no sign
    binade = _nucleus_binade(exponent, probs_N, top_p)
    while binade > 0:
        near = torch.nonzero(exponent >= binade).squeeze(1)  # ascending ids, ties included
        ids, probs = _sorted_desc(ids_N[near], probs_N[near])
        # enough once the running sum _nucleus takes (fp32, sorted) reaches top_p through these:
        # every token below then has at least that mass before it and goes. The histogram's sum
        # (fp64, other order) may round the other way: then one binade more.
        if probs.cumsum(0)[-1] >= top_p:
            return _nucleus(ids, probs, top_p)
        binade -= 1
    return _nucleus(*_sorted_desc(ids_N, probs_N), top_p)


def candidates(logits_V: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """What candidates_reference returns, without sorting the vocabulary: without top-p in id
    order (the order sample_next draws in), with top-p in the same order as the reference."""
    scores, masked = _scores(logits_V, params)
    kth = None
    if params.top_k and params.top_k < scores.numel():
        kth = float(torch.topk(scores, params.top_k).values[-1])
    ids, probs = _kept(scores, kth, masked)
    if params.top_p < 1.0:
        return _top_p_candidates(ids, probs, params.top_p)
    return ids, probs


def draw(probs_N: torch.Tensor, generator: torch.Generator | None) -> int:
    """Index into probs_N by inverse CDF of one fp64 uniform from generator."""
    cdf = probs_N.double().cumsum(0)
    u = torch.rand((), dtype=torch.float64, generator=generator)
    return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=probs_N.numel() - 1))


def sample_next(logits_BV: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> torch.Tensor:
    """One token per row, on the logits' device. Greedy takes the lowest id among equal maxima
    (argmax's rule); sampled rows draw one uniform each from generator, in row order."""
    if params.greedy:
        return logits_BV.argmax(-1)
    picked = []
    for row in logits_BV.detach().float().cpu():
        ids, probs = candidates(row, params)
        picked.append(int(ids[draw(probs, generator)]))
    return torch.tensor(picked, dtype=torch.int64, device=logits_BV.device)


def select_tokens(logits_BV: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None]) -> list[int]:
    """One token per row, row i picked by params[i] with generators[i], the token sample_next
    picks from that row, with less copied: greedy rows take their argmax where the logits are (the
    argmax of bf16 / fp16 logits is that of their exact fp32 copy, the lowest id among equal maxima
    on every device) and only their ids come to the host; the sampled rows come to the host in
    fp32, in one copy, and are sampled there with their CPU generators. A decode batch of greedy
    rows then copies 8 bytes per row instead of the vocab's logits (flash's 129,280 fp32 logits:
    0.5 MB per row)."""
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
