"""The stable top-k's row form (plugins/stable_topk/row_form.py: one program per row, the whole
select in one launch) against the stable sort, bit for bit, and the keys' treatment of -0.0 in
every form. Interpreter on the CPU (conftest sets TRITON_INTERPRET=1), the real kernels on a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

from dsflash.plugins.stable_topk import kernel as topk_kernel  # noqa: E402
from dsflash.plugins.stable_topk import reference as topk_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(launcher, scores: torch.Tensor, k: int, calls: int = 2) -> None:
    """The launcher's picks equal the stable sort's, indices and values, on `calls` calls."""
    want_v, want_i = topk_ref.stable_topk(scores, k)
    for _ in range(calls):
        got_v, got_i = launcher(scores.to(DEVICE), k)
        assert torch.equal(got_i.cpu(), want_i), (got_i.cpu(), want_i)
        assert torch.equal(got_v.cpu(), want_v)


@pytest.mark.parametrize("rows,n,k", [(3, 50, 4), (2, 300, 8), (1, 1000, 16), (2, 5, 8), (1, 3000, 100),
                                      (2, 700, 1), (1, 64, 64), (3, 2000, 512), (1, 16384, 512)])
@pytest.mark.parametrize("bits", [None, 1, 3, 11])
@pytest.mark.parametrize("prefilter", ["default", "none", "tight"])
def test_row_form_is_exact(gen, rows, n, k, bits, prefilter):
    """Ties (ReLU zeros, rounded values) to the lower index, -inf / +inf, k > N, k = 1, k = N, the
    largest row it serves (16K), digit passes of 1 bit (32 passes), 3 bits (a last pass of 2 bits)
    and 11 bits, twice on one launcher; with the block-max prefilter (blocks of 16, or of 1 entry
    where a row has fewer than k blocks), without it, and with blocks of 2 and room for only
    next_pow2(k) candidates, so that rows with more candidates take the whole-row passes."""
    scores = torch.relu(torch.randn(rows, n, generator=gen)).round(decimals=1)
    scores[0, ::7] = float("-inf")
    scores[-1, 3] = float("inf")
    over = ({"FORM": "row"} | ({"ROW_BITS": bits} if bits else {})
            | {"default": {}, "none": {"ROW_BLOCK": 1}, "tight": {"ROW_BLOCK": 2, "ROW_CAP": 16}}[prefilter])
    launcher = topk_kernel.StableTopkLauncher(overrides=over)
    assert launcher._form(n, min(k, n), 16, rows)[0] == "row"
    _check(launcher, scores, k)


def _hard_rows(gen) -> dict:
    """Rows whose k-th best is hard to find: name -> (scores, k)."""
    n = 2000
    ascending = torch.arange(n, dtype=torch.float32).expand(2, n).clone()
    ascending[1] = ascending[1].flip(0)
    sparse_ties = torch.full((1, n), -1.0)
    sparse_ties[0, ::100] = 0.0  # the k-th best is one of 20 zeros spread over the row
    sparse_ties[0, [5, 1234, 1999]] = 3.0
    runs = torch.relu(torch.randn(3, n, generator=gen)).round(decimals=1)
    runs[:, 640:700] = 9.0
    near = 1.0 + torch.arange(n, dtype=torch.float32).expand(2, n) * 2**-23  # keys one ulp apart
    continuous = torch.randn(2, n, generator=gen)
    return {"ascending": (ascending, 20), "sparse ties": (sparse_ties, 15), "equal run": (runs, 40),
            "all equal": (torch.zeros(2, n), 33), "all -inf": (torch.full((2, n), float("-inf")), 10),
            "one ulp apart": (near, 700), "continuous": (continuous, 512), "k = n": (continuous, n)}


@pytest.mark.parametrize("case", ["ascending", "sparse ties", "equal run", "all equal", "all -inf",
                                  "one ulp apart", "continuous", "k = n"])
@pytest.mark.parametrize("block", [1, 2, 16])
def test_row_form_is_exact_on_hard_rows(gen, case, block):
    """The k best at the end, the k-th best a tie spread over the row (the passes run to the last
    bit, then the first ties in index order), a run of equal best values, all equal (every entry a
    candidate: more than the prefilter holds), all -inf, neighbouring keys (every pass needed),
    continuous scores (the passes stop early) and k = N (no pass); without the prefilter, and with
    blocks of 2 and of 16 entries; one launcher each, so nothing may carry over between calls."""
    scores, k = _hard_rows(gen)[case]
    _check(topk_kernel.StableTopkLauncher(overrides={"FORM": "row", "ROW_BLOCK": block}), scores, k)


@pytest.mark.parametrize("form", ["radix", "prefilter", "row"])
def test_negative_zero_ties_with_zero(gen, form):
    """The reference's sort holds -0.0 equal to +0.0, so they keep index order; the keys once put
    -0.0 below +0.0 (the radix and block-max forms picked [4, 1, 3, 0] where the sort picks
    [4, 0, 1, 2] on the first row here). Every form, the k-th best among mixed zeros."""
    first = torch.tensor([[-0.0, 0.0, -0.0, 0.0, 1.0, -1.0]]).expand(2, 6).clone()
    mixed = torch.relu(torch.randn(2, 1024, generator=gen)).round(decimals=0)
    mixed[:, ::3] = torch.where(mixed[:, ::3] == 0, -0.0, mixed[:, ::3])
    launcher = topk_kernel.StableTopkLauncher(overrides={"FORM": form, "BLOCK": 2})
    _check(launcher, first, 4)
    k = int((mixed[0] > 0).sum()) + 50  # 50 zeros of the first row taken, of either sign
    _check(launcher, mixed, k)


@pytest.mark.parametrize("over,match", [({"ROW_BITS": 0}, "ROW_BITS must be 1..11"),
                                        ({"ROW_BITS": 12}, "ROW_BITS must be 1..11"),
                                        ({"ROW_WARPS": 64}, "ROW_WARPS must be at most 32"),
                                        ({"ROW_WARPS": 12}, "ROW_WARPS must be a power of two, got 12"),
                                        ({"ROW_CMP": 3}, "ROW_CMP must be a power of two, got 3"),
                                        ({"ROW_BLOCK": 6}, "ROW_BLOCK must be a power of two, got 6"),
                                        ({"ROW_CAP": 1000}, "ROW_CAP must be a power of two, got 1000")])
def test_row_form_refuses_bad_settings(over, match):
    """A row-form setting it cannot launch is refused before any launch, naming it."""
    launcher = topk_kernel.StableTopkLauncher(overrides={"FORM": "row"} | over)
    with pytest.raises(ValueError, match=match):
        launcher(torch.rand(2, 300, device=DEVICE), 8)
