import pytest
import torch

from dsflash.model.generate import SamplingParams, generate, sample_next

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
