import math

import torch

from dsflash.model.mhc import (
    hc_collapse,
    hc_mixes,
    hc_post,
    mhc_boundary,
    sinkhorn,
    split_mixes,
)
from dsflash.model.norm_rope import rms_norm

from tolerances import OP_FP32, SINKHORN_SUM, assert_close


def test_sinkhorn_is_doubly_stochastic(gen):
    # Unit-scale logits (what alpha * mu + b gives); the last step normalises columns exactly.
    logits = torch.randn(3, 5, 4, 4, generator=gen)
    c = sinkhorn(logits, iters=20, eps=1e-6)
    assert (c > 0).all()
    assert (c.sum(-1) - 1).abs().max() < SINKHORN_SUM
    assert (c.sum(-2) - 1).abs().max() < 1e-5
    # Peaked logits converge more slowly; more iterations get there (the 20 are the model's).
    c = sinkhorn(logits * 3, iters=300, eps=1e-6)
    assert (c.sum(-1) - 1).abs().max() < SINKHORN_SUM


def test_sinkhorn_hand_checked():
    # Uniform logits: the softmax rows are already doubly stochastic: every entry ~ 1/4.
    c = sinkhorn(torch.zeros(1, 1, 4, 4), iters=20, eps=1e-6)
    assert torch.allclose(c, torch.full_like(c, 0.25), atol=1e-5)
    # One iteration = row softmax (+eps) then one column normalisation, by hand for 2x2.
    logits = torch.tensor([[[[0.0, math.log(3.0)], [0.0, 0.0]]]])
    rows = torch.tensor([[0.25, 0.75], [0.5, 0.5]]) + 1e-6
    expect = rows / (rows.sum(0, keepdim=True) + 1e-6)
    assert torch.allclose(sinkhorn(logits, iters=1, eps=1e-6)[0, 0], expect, atol=1e-7)


def test_coefficients_and_update_follow_the_equations():
    hc, e = 2, 3
    mixes = torch.tensor([[[0.5, -1.0, 2.0, 0.0, 0.1, 0.2, 0.3, 0.4]]])
    base = torch.tensor([0.1, 0.0, -0.2, 0.3, 0.0, 0.0, 0.0, 0.0])
    scale = torch.tensor([2.0, 0.5, 1.0])
    pre, post, comb = split_mixes(mixes, base, scale, hc, iters=20, hc_eps=1e-6)
    sig = torch.sigmoid
    assert torch.allclose(pre[0, 0], torch.stack([sig(torch.tensor(1.1)), sig(torch.tensor(-2.0))]) + 1e-6)
    assert torch.allclose(post[0, 0], 2 * torch.stack([sig(torch.tensor(0.8)), sig(torch.tensor(0.3))]))
    # Update: R'_k = post_k y + sum_j comb[j,k] R_j (comb transposed), by explicit loops.
    r = torch.arange(6.0).view(1, 1, hc, e)
    y = torch.tensor([[[1.0, -1.0, 2.0]]])
    new = hc_post(r, y, post, comb)
    for k in range(hc):
        expect = post[0, 0, k] * y[0, 0] + sum(comb[0, 0, j, k] * r[0, 0, j] for j in range(hc))
        assert torch.allclose(new[0, 0, k], expect, atol=1e-6)
    # Collapse uses the pre handed in (shift): x = sum_i pi_i R_i.
    pi = torch.tensor([[[0.25, 0.75]]])
    assert torch.allclose(hc_collapse(r, pi)[0, 0], 0.25 * r[0, 0, 0] + 0.75 * r[0, 0, 1])


def _site(gen, hc, e):
    n_mix = (2 + hc) * hc
    return (torch.randn(n_mix, hc * e, generator=gen) / (hc * e) ** 0.5,
            torch.randn(n_mix, generator=gen) * 0.1, torch.rand(3, generator=gen) + 0.5)


def test_fused_boundary_equals_op_by_op(gen):
    hc, e, b, s = 4, 48, 2, 5
    streams = torch.randn(b, s, hc, e, generator=gen)
    y = torch.randn(b, s, e, generator=gen)
    pre, post, comb = split_mixes(torch.randn(b, s, (2 + hc) * hc, generator=gen),
                                  *_site(gen, hc, e)[1:], hc, 20, 1e-6)
    fn, base, scale = _site(gen, hc, e)
    w = torch.rand(e, generator=gen) + 0.5
    new, x, p2, q2, c2 = mhc_boundary(streams, y, post, comb, pre, fn, base, scale, w, 20, 1e-6, 1e-20)
    ref_new = hc_post(streams, y, post, comb)
    ref_pre, ref_post, ref_comb = hc_mixes(ref_new, fn, base, scale, 20, 1e-6, 1e-20)
    ref_x = rms_norm(hc_collapse(ref_new, pre), w, 1e-20)
    for got, ref, name in ((new, ref_new, "streams"), (x, ref_x, "x"), (p2, ref_pre, "pre"),
                           (q2, ref_post, "post"), (c2, ref_comb, "comb")):
        assert_close(got, ref, OP_FP32, name)


def test_shifted_form_differs_from_standard(gen):
    """V4.1 collapses with the previous site's pre; V4 with the pre of the same residual."""
    hc, e = 4, 16
    streams = torch.randn(1, 3, hc, e, generator=gen)
    fn, base, scale = _site(gen, hc, e)
    pre_same, _, _ = hc_mixes(streams, fn, base, scale, 20, 1e-6, 1e-20)
    carried = torch.zeros(1, 3, hc)
    carried[..., 0] = 1.0
    assert not torch.allclose(hc_collapse(streams, pre_same), hc_collapse(streams, carried), atol=1e-3)
