"""The sampler: its fast candidates against the sorting spec, its tie rules, its one-uniform draw."""

import pytest
import torch

from dsflash.model import sampling
from dsflash.model.sampling import (SamplingParams, candidates, candidates_reference, candidates_rows, draw,
                                    sample_next)


def _by_id(ids, probs):
    order = torch.argsort(ids)
    return ids[order], probs[order]


def _assert_same_candidates(row, params):
    got_ids, got_p = candidates(row, params)
    want_ids, want_p = candidates_reference(row, params)
    if params.top_p < 1.0:  # both in (probability desc, id asc) order
        assert torch.equal(got_ids, want_ids) and torch.equal(got_p, want_p), params
    else:  # the fast path keeps id order: the same set with the same probabilities
        got, want = _by_id(got_ids, got_p), _by_id(want_ids, want_p)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), params
    return got_ids


@pytest.mark.parametrize("vocab", [7, 300, 5000, 129_280])
def test_candidates_match_the_sorting_spec(vocab, gen):
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=0.7, top_p=0.999),
              SamplingParams(temperature=1.3, top_k=40), SamplingParams(temperature=2.0),
              SamplingParams(temperature=0.9, top_k=50, top_p=0.8),
              SamplingParams(temperature=1.0, top_k=768, top_p=0.95)]
    sizes = set()
    for scale in (0.5, 3.0):  # flat rows need a wide nucleus (the search grows), peaked ones not
        logits = (torch.randn(3, vocab, generator=gen) * scale).to(torch.bfloat16)  # bf16: many ties
        for row in logits:
            for p in params:
                sizes.add(int(_assert_same_candidates(row, p).numel()))
    if vocab > 1000:
        assert max(sizes) > 1000  # flat rows: wide nuclei, many binades sorted


def test_top_p_at_the_histograms_binade_sums(gen):
    """top_p exactly at the fp64 mass of whole binades: where the fp32 running sum rounds below it,
    the fast path takes one more binade and still matches the spec."""
    for scale in (1.0, 3.0):
        row = torch.randn(20_000, generator=gen) * scale
        probs = torch.softmax(row, 0)
        exponent = probs.view(torch.int32) >> 23
        for e in exponent.unique()[-12:]:
            top_p = float(probs[exponent >= e].double().sum())
            if top_p < 1.0:
                _assert_same_candidates(row, SamplingParams(temperature=1.0, top_p=top_p))


def test_top_p_takes_more_binades_while_the_running_sum_falls_short(gen, monkeypatch):
    """The histogram's fp64 sums and the fp32 running sum may round apart: the fast path checks the
    running sum and widens. Forced here by starting at the top binade, too narrow for top_p 0.9."""
    row = torch.randn(5000, generator=gen) * 2.0
    monkeypatch.setattr(sampling, "_nucleus_binade", lambda exponent, probs, top_p: int(exponent.max()))
    assert _assert_same_candidates(row, SamplingParams(temperature=1.0, top_p=0.9)).numel() > 50


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_in_one_batch_get_what_each_gets_alone(dtype, gen):
    """candidates_rows is candidates() of every row, bit for bit: its batched top-k (bf16 rows tie
    at the k-th: the batch pads to its widest row) and the rows it sends alone (-inf among a row's
    k, a row without top-k)."""
    logits = (torch.randn(7, 3000, generator=gen) * 3).to(dtype)
    logits[2, :2900] = float("-inf")  # 100 finite: alone where k > 100, in the batch below
    logits[4, [10, 20, 30]] = torch.topk(logits[4], 40).values[-1]  # ties at the 40th
    for params in (SamplingParams(temperature=0.9, top_k=40), SamplingParams(temperature=1.2, top_p=0.9),
                   SamplingParams(temperature=0.8, top_k=40, top_p=0.7), SamplingParams(temperature=1.0),
                   SamplingParams(temperature=1.0, top_k=200, top_p=0.95)):
        batch = candidates_rows(logits, params)
        for i, (ids, probs) in enumerate(batch):
            want_ids, want_probs = candidates(logits[i], params)
            assert torch.equal(ids, want_ids) and torch.equal(probs, want_probs), (i, params)
    widths = [len(ids) for ids, _ in candidates_rows(logits, SamplingParams(temperature=1.0, top_k=40))]
    assert widths[4] >= 43 and min(widths) >= 40  # row 4: its three extra ties with the 40th stay


def test_a_bad_row_in_a_batch_is_named(gen):
    logits = torch.randn(40, 10, generator=gen)  # three passes of ROWS_PER_PASS rows
    params = SamplingParams(temperature=1.0, top_k=3)
    assert [c[0].tolist() for c in candidates_rows(logits, params)] == [
        candidates(row, params)[0].tolist() for row in logits]
    logits[33, 4] = float("nan")
    with pytest.raises(ValueError, match="row 33: cannot sample from logits with NaN or \\+inf at id 4"):
        candidates_rows(logits, params)
    with pytest.raises(ValueError, match="rows of logits \\[rows, vocab\\] expected, got shape \\(10,\\)"):
        candidates_rows(logits[0], SamplingParams(temperature=1.0))


def test_ties_top_k_keeps_them_and_top_p_cuts_by_ascending_id():
    row = torch.tensor([3.0, 1.0, 3.0, 3.0, 0.0])
    ids, probs = candidates(row, SamplingParams(temperature=1.0, top_k=2))
    assert ids.tolist() == [0, 2, 3]  # three tie with the 2nd largest: all stay
    assert torch.allclose(probs.sum(), torch.tensor(1.0))
    row = torch.full((10,), float("-inf"))
    row[[9, 2, 5, 7]] = 1.0  # four equal tokens, 0.25 each
    ids, _ = candidates(row, SamplingParams(temperature=1.0, top_p=0.5))
    assert ids.tolist() == [2, 5]  # mass before: 0, 0.25 (kept), 0.5 (reaches top_p: dropped)
    assert candidates_reference(row, SamplingParams(temperature=1.0, top_p=0.5))[0].tolist() == [2, 5]


def test_masked_tokens_are_never_candidates():
    row = torch.tensor([float("-inf"), 2.0, float("-inf"), 1.0, float("-inf")])
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=4),
                   SamplingParams(temperature=1.0, top_k=4, top_p=0.99)):
        for find in (candidates, candidates_reference):
            assert sorted(find(row, params)[0].tolist()) == [1, 3], (find.__name__, params)


def test_draw_is_the_inverse_cdf_of_one_uniform():
    probs = torch.tensor([0.2, 0.5, 0.3])
    for seed in range(40):
        u = float(torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
        want = 0 if u < 0.2 else 1 if u < 0.7 else 2
        assert draw(probs, torch.Generator().manual_seed(seed)) == want, (seed, u)


def test_sampling_takes_one_uniform_per_row_whatever_the_vocab(gen):
    for vocab in (5, 129_280):
        logits = torch.randn(3, vocab, generator=gen)
        g = torch.Generator().manual_seed(11)
        sample_next(logits, SamplingParams(temperature=1.0, top_p=0.9, seed=11), g)
        ref = torch.Generator().manual_seed(11)
        for _ in range(3):
            torch.rand((), dtype=torch.float64, generator=ref)
        assert torch.equal(g.get_state(), ref.get_state()), vocab


def test_sampled_frequencies_follow_the_truncated_distribution():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    g = torch.Generator().manual_seed(0)
    n = 20_000
    params = SamplingParams(temperature=1.0, top_k=4)  # drops the 0.05 token, renormalizes the rest
    counts = torch.bincount(torch.cat([sample_next(logits, params, g) for _ in range(n)]), minlength=5)
    want = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.0]) / 0.95
    sigma = (want * (1 - want) / n).sqrt()
    assert counts[4] == 0
    assert ((counts / n - want).abs() <= 4 * sigma + 1e-12).all(), counts


def test_bad_logits_name_what_is_wrong():
    with pytest.raises(ValueError, match="NaN or \\+inf at id 2 \\(vocab 4\\)"):
        candidates(torch.tensor([0.0, 1.0, float("nan"), 2.0]), SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="every logit -inf"):
        candidates(torch.full((3,), float("-inf")), SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="temperature=1e-38 overflows the logits"):
        candidates(torch.tensor([0.0, 50.0]), SamplingParams(temperature=1e-38))
    with pytest.raises(ValueError, match="one row of logits \\[vocab\\] expected, got shape \\(2, 3\\)"):
        candidates(torch.zeros(2, 3), SamplingParams(temperature=1.0))
