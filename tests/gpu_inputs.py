"""Inputs at the released sizes for the GPU tests (tests/test_kernels_gpu.py, tests/test_aot_gpu.py)
and the poisoned allocator that catches an output element a kernel leaves unwritten."""

from __future__ import annotations

import torch

BF16 = torch.bfloat16


def poison_allocator(nbytes: int = 1 << 30) -> None:
    """Fill a large cached block with NaN and free it: the kernels' torch.empty outputs come from
    it, so an element a kernel fails to write stays NaN and fails the comparison."""
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


def cuda(*ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


def engram_inputs(gen, batch, new, look=3, heads=8, dim=256, rows_per_head=30011):
    primes = [rows_per_head + 2 * i for i in range(look * heads)]
    offsets = [sum(primes[:i]) for i in range(len(primes))]
    mult = [int(m) * 2 + 1 for m in torch.randint(1, 2**30, (look + 1,), generator=gen)]
    cids = torch.randint(0, 16384, (batch, look + new), generator=gen)
    cids[:, :look] = -1
    return cids, sum(primes), mult, primes, offsets


def mhc_inputs(gen, tokens, c=4, e=5120):
    n_mix = (2 + c) * c
    return (torch.randn(1, tokens, c, e, generator=gen).to(BF16),
            torch.randn(1, tokens, e, generator=gen).to(BF16),
            torch.rand(1, tokens, c, generator=gen) * 2, torch.rand(1, tokens, c, c, generator=gen),
            torch.rand(1, tokens, c, generator=gen) + 0.5,
            torch.randn(n_mix, c * e, generator=gen) * e ** -0.5,
            torch.randn(n_mix, generator=gen), torch.rand(3, generator=gen) + 0.5,
            (torch.rand(e, generator=gen) + 0.5).to(BF16))


def attention_inputs(gen, s, n=5000, k=512, batch=1):
    """(q, kv, idx, win_kv, win_mask, sink, scale) for `batch` sequences of s query rows at the
    released head sizes (a decode step: s = 1, one row per sequence, each over its own entries):
    indices from -1 (none) up, a window of 128 + s keys partly masked."""
    t = 128 + s
    b = batch
    return (torch.randn(b, s, 64, 512, generator=gen).to(BF16),
            torch.randn(b, n, 512, generator=gen).to(BF16),
            torch.randint(-1, n, (b, s, k), generator=gen), torch.randn(b, t, 512, generator=gen).to(BF16),
            torch.rand(b, s, t, generator=gen) > 0.3, torch.randn(64, generator=gen), 512 ** -0.5)
