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
# candidates_rows' rows per [rows, vocab] pass: at flash's vocabulary 16 fp32 rows are 8 MB. 64
# rows in one pass (33 MB) took 50 ms on the 2-core CPU machine against 31 in passes of 16 and 36
# row by row (top-k 50, 2026-12-06); on the GPU host's 16 threads one pass of 32 rows took 4.2 ms
# against 24.2 row by row.
ROWS_PER_PASS = 16


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


def softmax_in_order(scores_RN: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim whose sum is taken in order (fp64 running sum, then fp32): the
    same bits for the same scores in the same order whatever else the row holds, -inf (exactly 0)
    anywhere after them. torch.softmax's vectorized sum rounds by layout, so a row of a padded
    batch (candidates_rows) and the same tokens alone could get different probabilities."""
    top = scores_RN.amax(-1, keepdim=True)
    e = torch.exp(scores_RN - top)
    total = e.double().cumsum(-1)[..., -1:]
    return (e.double() / total).float()


def _kept(scores_V: torch.Tensor, kth: float | None, masked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids top-k keeps (every finite score >= the k-th largest, kth; None: every finite one),
    in id order, and their probabilities: the softmax of their scores alone (top-k's few summed in
    order, as candidates_rows sums them). A -inf logit (a masked token) is never kept, also where
    fewer than k tokens are finite (kth = -inf)."""
    if kth is not None:
        kept = scores_V >= kth
        ids = torch.nonzero(kept & (scores_V > -math.inf) if masked else kept).squeeze(1)
        return ids, softmax_in_order(scores_V[ids])
    if masked:
        ids = torch.nonzero(scores_V > -math.inf).squeeze(1)
        return ids, torch.softmax(scores_V[ids], dim=0)
    return torch.arange(scores_V.numel()), torch.softmax(scores_V, dim=0)  # every token: no gather


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


def candidates_rows(logits_RV: torch.Tensor,
                    params: SamplingParams) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """candidates() of every row of logits_RV [rows, vocab], the same tensors. Top-k rows share
    their passes over the vocabulary, ROWS_PER_PASS rows at a time (a [rows, vocab] top-k, which
    torch spreads over the CPU's threads); the rest go one by one, as do a top-k row with -inf
    logits among its k and a row candidates() refuses (its error then names the row). Without
    top-k a batch is slower: [rows, vocab] fp32 softmax passes leave the cache (session 41,
    docs/benchmarks.md)."""
    if logits_RV.dim() != 2 or 0 in logits_RV.shape:
        raise ValueError(f"rows of logits [rows, vocab] expected, got shape {tuple(logits_RV.shape)}")
    rows = f32(logits_RV).cpu()
    out: list = []
    for first in range(0, rows.shape[0], ROWS_PER_PASS):
        out += _candidates_of_rows(rows[first:first + ROWS_PER_PASS], params, first)
    return out


def _candidates_of_rows(rows: torch.Tensor, params: SamplingParams,
                        first: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """candidates_rows of up to ROWS_PER_PASS fp32 host rows, the first of them row `first`."""
    vocab = rows.shape[1]
    top_k = params.top_k if params.top_k and params.top_k < vocab else 0
    out: list = [None] * rows.shape[0]
    alone = torch.ones(rows.shape[0], dtype=torch.bool)
    if top_k and rows.shape[0] > 1:
        high = rows.amax(1)
        scores = rows / params.temperature
        top = torch.topk(scores, top_k, dim=1)
        kth = top.values[:, -1:]
        alone = ~torch.isfinite(high) | (scores.amax(1) == math.inf) | (kth[:, 0] == -math.inf)
    for i in alone.nonzero().squeeze(1).tolist():
        try:
            out[i] = candidates(rows[i], params)
        except ValueError as err:
            raise ValueError(f"row {first + i}: {err}") from err
    batch = (~alone).nonzero().squeeze(1)
    if not batch.numel():
        return out
    # every row's kept tokens (its ties with its k-th too) among the widest row's top-k, in id
    # order as _kept's nonzero gives them; the rest padded after them (id vocab, score -inf)
    scores, kth = scores[batch], kth[batch]
    widest = int((scores >= kth).sum(1).max())
    if widest > top_k:
        top = torch.topk(scores, widest, dim=1)
    else:
        top = torch.return_types.topk((top.values[batch], top.indices[batch]))
    valid = top.values >= kth
    ids, order = torch.sort(torch.where(valid, top.indices, vocab), dim=1)
    valid = valid.gather(1, order)
    probs = softmax_in_order(torch.where(valid, top.values.gather(1, order), -math.inf))
    if params.top_p < 1.0:  # a few tokens each: sort them all, the reference's way
        order = torch.argsort(-probs, dim=1, stable=True)
        ids, probs, valid = ids.gather(1, order), probs.gather(1, order), valid.gather(1, order)
        before = torch.cat([probs.new_zeros(len(batch), 1), probs.cumsum(1)[:, :-1]], dim=1)
        valid &= before < params.top_p
    for j, i in enumerate(batch.tolist()):
        out[i] = (ids[j][valid[j]], probs[j][valid[j]])
    return out


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
    rows = candidates_rows(logits_BV.detach(), params)
    picked = [int(ids[draw(probs, generator)]) for ids, probs in rows]
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
        # rows of one temperature / top-k / top-p share candidates_rows' passes (seeds may differ)
        groups: dict = {}
        for j, i in enumerate(sampled):
            groups.setdefault((params[i].temperature, params[i].top_k, params[i].top_p), []).append(j)
        found: list = [None] * len(sampled)
        for group in groups.values():
            for j, cand in zip(group, candidates_rows(host[torch.tensor(group)], params[sampled[group[0]]])):
                found[j] = cand
        for j, i in enumerate(sampled):  # each row's one uniform from its own generator
            ids, probs = found[j]
            tokens[i] = int(ids[draw(probs, generators[i])])
    return tokens
