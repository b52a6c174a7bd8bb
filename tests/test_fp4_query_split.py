"""The FP8 index kernels' query split (plugins/csa2_index_score/fp4_mma.py) on kv_qat queries: the
model rounds its index queries with fp4_pow2_qat (model/attention.py), so the split's hi part
holds them exactly, and with LO_SKIP (the listed kernel's default) a row without a lo part runs
without the lo products (one branch per program). Checked: which rows have a lo part (a probe of
the split itself), and that both kernels, with and without LO_SKIP, score kv_qat queries, rows
with a lo part beside them, as the reference does. Interpreter on the CPU (exact FP8 products:
the fp32 bound), bf16 on a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import assert_kernel_matches

from dsflash.plugins.launch import interpreting

triton = pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
import triton.language as tl  # noqa: E402

from dsflash.model.quant import fp4_pow2_pack, fp4_pow2_qat  # noqa: E402
from dsflash.plugins.csa2_index_score import fp4_mma, pooled_fp4  # noqa: E402
from dsflash.plugins.csa2_index_score import kernel as index_kernel  # noqa: E402
from dsflash.plugins.csa2_index_score import reference as index_ref  # noqa: E402
from dsflash.plugins.launch import next_pow2  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 queries on the GPU (the kernels' only dtype there); the interpreter cannot multiply bf16
QUERY_DTYPE = torch.float32 if interpreting() else torch.bfloat16


def _dev(*ts):
    return [t.to(DEVICE) for t in ts]


@triton.jit
def _has_lo_probe(q_ptr, out_ptr, I: tl.constexpr, J: tl.constexpr, JP: tl.constexpr):
    """One program per query row: 1 where the kernels' split of the row has a nonzero lo part."""
    row = tl.program_id(0).to(tl.int64)
    _, _, _, _, has_lo = fp4_mma._query_parts(q_ptr, row, I, J, JP)
    tl.store(out_ptr + row, has_lo.to(tl.int32))


def _queries(gen, rows: int, heads: int, dim: int) -> torch.Tensor:
    """kv_qat index queries: random activations over 2^-4..2^4, rounded as the model rounds them."""
    spread = torch.logspace(-4, 4, rows, base=2.0).view(rows, 1, 1)
    return fp4_pow2_qat(torch.randn(rows, heads, dim, generator=gen) * spread).to(QUERY_DTYPE)


def _give_lo(q_RIJ: torch.Tensor, row: int, head: int, channel: int) -> None:
    """Make one query 2^floor(log2 max|q_head|) (1 + 2^-7): 8 significant bits (bf16 holds them),
    in the top binade of its head, where the split's lo part holds the last 4."""
    top = torch.floor(torch.log2(q_RIJ[row, head].abs().max().float()))
    q_RIJ[row, head, channel] = (2.0**top * (1.0 + 2.0**-7)).to(q_RIJ.dtype)


def _has_lo(q_RIJ: torch.Tensor) -> list[int]:
    rows, heads, dim = q_RIJ.shape
    (q,) = _dev(q_RIJ.contiguous())
    out = torch.full((rows,), -1, dtype=torch.int32, device=DEVICE)
    _has_lo_probe[(rows,)](q, out, I=heads, J=dim, JP=next_pow2(dim))
    return out.tolist()


def test_split_has_no_lo_for_kv_qat_queries(gen):
    """kv_qat rows: no lo part, so their blocks run without the lo products; a row with one query
    of 8 significant bits has one, and a row of the tensor-core test's queries (8 significant
    bits each): their blocks keep both products."""
    q = _queries(gen, 4, 16, 128)
    assert _has_lo(q) == [0, 0, 0, 0]
    _give_lo(q, 1, 9, 77)
    q[2] = (torch.randint(1, 256, (16, 128), generator=gen) / 64.0).to(QUERY_DTYPE)
    assert _has_lo(q) == [0, 1, 1, 0]


@pytest.mark.parametrize("skip", [False, True], ids=["both_products", "lo_skip"])
@pytest.mark.parametrize("over", [{}, {"STAGES": 2, "BLOCKS": 3}], ids=["branch", "pipelined"])
def test_mask_form_scores_kv_qat_queries(gen, over, skip):
    """The FP8 path of Csa2IndexScore(fp4) on kv_qat queries, with one row (b 1, s 0) given a lo
    part, so that one launch runs both loops: the reference's scores by the bound of the query
    dtype."""
    b, s, heads, dim, n = 2, 3, 16, 128, 200
    q = _queries(gen, b * s, heads, dim).view(b, s, heads, dim)
    _give_lo(q.view(b * s, heads, dim), 3, 2, 5)
    assert _has_lo(q.view(b * s, heads, dim)) == [0, 0, 0, 1, 0, 0]
    w = torch.randn(b, s, heads, generator=gen)
    spread = torch.logspace(-4, 4, n).view(1, n, 1)
    codes, exps = fp4_pow2_pack(torch.randn(b, n, dim, generator=gen) * spread)
    visible = torch.rand(b, s, n, generator=gen) > 0.3
    args = (q, w, codes, exps, visible)
    got = index_kernel.csa2_index_score_fp4(*_dev(*args), overrides={"PATH": "mma", "LO_SKIP": skip} | over)
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4, args, {}, QUERY_DTYPE,
                          f"Csa2IndexScore(fp4, FP8, kv_qat queries, {over}, LO_SKIP {skip})")


@pytest.mark.parametrize("over", [{}, {"STAGES": 2, "BLOCKS": 3, "BLOCK_N": 32}],
                         ids=["branch", "pipelined"])
@pytest.mark.parametrize("skip", [True, False], ids=["lo_skip", "both_products"])
def test_listed_form_scores_kv_qat_queries(gen, over, skip):
    """The listed pool's FP8 kernel (pooled_fp4.py) likewise, -1 padding and ids past N among the
    listed slots."""
    b, s, heads, dim, n, p = 2, 2, 32, 128, 160, 90
    q = _queries(gen, b * s, heads, dim).view(b, s, heads, dim)
    _give_lo(q.view(b * s, heads, dim), 1, 7, 100)
    assert _has_lo(q.view(b * s, heads, dim)) == [0, 1, 0, 0]
    w = torch.randn(b, s, heads, generator=gen)
    codes, exps = fp4_pow2_pack(torch.randn(b, n, dim, generator=gen))
    entries = torch.randint(0, n, (b, s, p), generator=gen).sort(dim=-1).values.int()
    entries[1, 1, p // 2:] = -1
    entries[0, 0, :2] = torch.tensor([n, n + 3])
    args = (q, w, codes, exps, entries)
    got = pooled_fp4.csa2_index_score_fp4_pooled(*_dev(*args), overrides=over | {"LO_SKIP": skip})
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4_pooled, args, {}, QUERY_DTYPE,
                          f"Csa2IndexScore(fp4, pooled, kv_qat queries, {over}, LO_SKIP {skip})")
