import pytest
import torch

from dsflash.model.generate import generate
from dsflash.model.sampling import SamplingParams, sample_next, select_tokens

from conftest import random_ids


def test_greedy_generate_matches_forward_argmax(tiny_model, gen):
    prompt = random_ids(gen, 1, 13, tiny_model.cfg.vocab_size)[0].tolist()
    out = generate(tiny_model, [prompt], 6, mode="exact")[0]
    seq = list(prompt)
    for _ in range(6):
        with torch.no_grad():
            seq.append(int(tiny_model(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(prompt):]


def test_seeded_sampling_reproducible_and_topk1_is_greedy(tiny_model, gen):
    prompts = [random_ids(gen, 1, n, tiny_model.cfg.vocab_size)[0].tolist() for n in (5, 12)]
    p = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=7)
    a, b = generate(tiny_model, prompts, 8, p), generate(tiny_model, prompts, 8, p)
    assert a == b
    c = generate(tiny_model, prompts, 8, SamplingParams(temperature=0.9, top_p=0.9, seed=8))
    assert a != c
    g1 = generate(tiny_model, prompts, 8, SamplingParams(temperature=0.7, top_k=1, seed=1))
    assert g1 == generate(tiny_model, prompts, 8)


def test_top_p_keeps_the_nucleus_only():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen = {int(sample_next(logits, SamplingParams(temperature=1.0, top_p=0.7), gen)) for _ in range(200)}
    assert seen == {0, 1}


def test_bad_sampling_params():
    with pytest.raises(ValueError, match="top_p=0.0 must be in"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature=-1"):
        SamplingParams(temperature=-1)
    for bad in (float("nan"), float("inf")):  # NaN compared as no error; inf sampled uniformly
        with pytest.raises(ValueError, match=f"temperature={bad} must be finite and >= 0"):
            SamplingParams(temperature=bad)


class _CopySpy(torch.Tensor):
    """Logits that record the row counts of every copy to the host or to fp32 made of rows of them
    (a [rows, vocab] tensor; the sampler's own copies of one row [vocab] are not counted)."""
    copies: list

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.cpu, torch.Tensor.float) and isinstance(args[0], cls) and args[0].dim() == 2:
            cls.copies.append(args[0].shape[0])
        return super().__torch_function__(func, types, args, kwargs or {})


def test_select_tokens_picks_what_sample_next_picks_and_copies_only_sampled_rows(gen):
    vocab = 300
    logits = torch.randn(6, vocab, generator=gen).to(torch.bfloat16)
    logits[1, [7, 200]] = logits[1].max() + 1  # a tie: the lower id wins, as argmax's rule
    params = [SamplingParams(), SamplingParams(),
              SamplingParams(temperature=0.8, top_k=40, seed=3), SamplingParams(temperature=0.5, top_k=1),
              SamplingParams(temperature=1.1, top_p=0.9, seed=4), SamplingParams()]
    seeds = [None, None, 3, None, 4, None]

    def generators():
        return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    spy = logits.as_subclass(_CopySpy)
    _CopySpy.copies = []
    got = select_tokens(spy, params, generators())
    # as the generator picked them before: each row copied to the host in fp32, then sample_next
    want = [int(sample_next(logits[i:i + 1].float(), p, g)[0]) for i, (p, g) in
            enumerate(zip(params, generators()))]
    assert got == want and got[1] == 7
    # the two sampled rows leave together (then sample_next copies each one's probabilities); never
    # the batch's six
    assert _CopySpy.copies[:2] == [2, 2] and max(_CopySpy.copies) == 2
    _CopySpy.copies = []
    greedy = [SamplingParams()] * 6
    assert select_tokens(spy, greedy, [None] * 6) == logits.float().argmax(-1).tolist()
    assert _CopySpy.copies == []  # greedy rows: only their ids leave the device


def test_select_tokens_refuses_mismatched_arguments():
    with pytest.raises(ValueError, match="logits \\(2, 5\\) must be \\[rows, vocab\\] with one params and "
                                         "one generator per row; got 1 params and 2 generators"):
        select_tokens(torch.zeros(2, 5), [SamplingParams()], [None, None])
    with pytest.raises(ValueError, match="logits \\(5,\\)"):
        select_tokens(torch.zeros(5), [SamplingParams()], [None])
