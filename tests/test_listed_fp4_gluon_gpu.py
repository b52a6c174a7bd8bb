"""The listed pool's FP4 index scores by the Gluon kernel (plugins/csa2_index_score/
listed_fp4_gluon.py): on an sm_90 GPU, the bits of Triton's kernel (pooled_fp4.py) and the
reference's tolerance, at the released sizes and on irregular shapes; anywhere, the refusals."""

from __future__ import annotations

import pytest
import torch
from gpu_inputs import cuda, poison_allocator
from kernel_checks import assert_kernel_matches

from dsflash.model import csa2_ops
from dsflash.model.quant import fp4_pow2_pack, fp4_pow2_qat
from dsflash.plugins.csa2_index_score import reference as index_ref
from dsflash.plugins.csa2_index_score.listed_fp4_gluon import (
    csa2_index_score_fp4_listed_gluon,
    listed_gluon_problem,
)

BF16 = torch.bfloat16
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
LAUNCHES = {"default": {}, "64x4": {"BLOCK_N": 64, "BLOCKS": 5, "STAGES": 4},
            "128x4": {"BLOCK_N": 128, "BLOCKS": 3, "STAGES": 4},
            "128x2_uncapped": {"BLOCK_N": 128, "BLOCKS": 7, "STAGES": 2, "maxnreg": None}}
WHAT = "gluon listed fp4 score"


def _pool_inputs(gen, rows, n, block=8, kept=512, queries="bf16"):
    """A Reindex layer's pool as OpSet("triton") lists it: `kept` blocks of `block` entries of n,
    ascending ids, -1 past the members (the newest partial block among them)."""
    q = torch.randn(rows, 1, 32, 128, generator=gen).to(BF16)
    if queries == "qat":
        q = fp4_pow2_qat(q)
    w = torch.randn(rows, 1, 32, generator=gen)
    codes, exps = fp4_pow2_pack(torch.randn(rows, n, 128, generator=gen))
    blocks = -(-n // block)
    picks = torch.rand(rows, blocks, generator=gen).argsort(dim=1)[:, :kept]
    picks[:, 0] = blocks - 1
    pool = torch.zeros(rows, blocks, dtype=torch.bool).scatter(1, picks, True)
    member = pool.repeat_interleave(block, dim=1)[:, :n].view(rows, 1, n)
    return q, w, codes, exps, csa2_ops.pool_entry_list(member, kept * block)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("queries", ["bf16", "qat"])
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_gluon_listed_fp4_flash_sizes(gen, launch, queries):
    """12 rows of 16,411 entries, 512 blocks of 8 listed: the reference's tolerance, and Triton's
    bits at every slot (the same products in the same order), for bf16 queries (hi and lo products)
    and kv_qat ones (no lo part: the loop without the lo products)."""
    from dsflash.plugins.csa2_index_score.pooled_fp4 import csa2_index_score_fp4_pooled

    args = _pool_inputs(gen, 12, 16411, queries=queries)
    poison_allocator()
    got = csa2_index_score_fp4_listed_gluon(*cuda(*args), overrides=LAUNCHES[launch])
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4_pooled, args, {}, BF16, WHAT)
    assert torch.equal(got, csa2_index_score_fp4_pooled(*cuda(*args)))


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("heads", [16, 32, 64])
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_gluon_listed_fp4_irregular(gen, launch, heads):
    """Batch 3 x 2 query rows (two rows per sequence) over 1,000 entries, 201 slots (no whole block
    at the end, runs cut short), int64 ids with -1 and ids past N mixed in (-inf, their keys
    unread); one slot list of a single slot; all-zero queries of one head; 16, 32 and 64 heads."""
    from dsflash.plugins.csa2_index_score.pooled_fp4 import csa2_index_score_fp4_pooled

    b, s, n, p = 3, 2, 1000, 201
    q = torch.randn(b, s, heads, 128, generator=gen).to(BF16)
    q[1, 0, 5] = 0
    w = torch.randn(b, s, heads, generator=gen)
    codes, exps = fp4_pow2_pack(torch.randn(b, n, 128, generator=gen) * 3)
    ids = torch.randint(-1, n + 50, (b, s, p), generator=gen)
    args = (q, w, codes, exps, ids)
    poison_allocator()
    got = csa2_index_score_fp4_listed_gluon(*cuda(*args), overrides=LAUNCHES[launch])
    assert torch.isneginf(got[(ids < 0) | (ids >= n)]).all()
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4_pooled, args, {}, BF16, WHAT)
    assert torch.equal(got, csa2_index_score_fp4_pooled(*cuda(*args)))
    one = csa2_index_score_fp4_listed_gluon(*cuda(q, w, codes, exps, ids[:, :, :1]),
                                            overrides=LAUNCHES[launch])
    assert torch.equal(one, got[:, :, :1])


def test_gluon_listed_fp4_refuses_what_it_cannot_run():
    """fp32 queries, a head count other than 16, 32 or 64, and channels other than
    128 are refused on any device, naming the value; so are CPU tensors (no interpreter form)."""
    args = (torch.zeros(1, 1, 32), torch.zeros(1, 8, 64, dtype=torch.uint8),
            torch.zeros(1, 8, 4, dtype=torch.int8), torch.zeros(1, 1, 4, dtype=torch.int32))
    device = "cuda" if SM90 else "cpu"
    with pytest.raises(ValueError, match="bf16 queries, got torch.float32"):
        csa2_index_score_fp4_listed_gluon(*[t.to(device) for t in (torch.zeros(1, 1, 32, 128), *args)])
    assert "got 24" in listed_gluon_problem(torch.zeros(1, 1, 24, 128, dtype=BF16))
    assert "got 128" in listed_gluon_problem(torch.zeros(1, 1, 128, 128, dtype=BF16))
    assert "got 64" in listed_gluon_problem(torch.zeros(1, 1, 32, 64, dtype=BF16))
    if not SM90:
        with pytest.raises(ValueError, match="CUDA GPU|sm_90"):
            csa2_index_score_fp4_listed_gluon(torch.zeros(1, 1, 32, 128, dtype=BF16), *args)
