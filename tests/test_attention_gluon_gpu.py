"""The warp-specialized Gluon form of Csa2SparseAttention (gluon_batch.py, the launcher's GLUON
option, its default for the batch form on sm_90) against the reference: decode rows, the batch's
splits, the unsplit launch, several sequences with their own entries, ragged key lists and
window, ids of -1, a CUDA-graph replay. Run by scripts/gpu_check.sh; skipped without an sm_90 GPU."""

from __future__ import annotations

import pytest
import torch
from gpu_inputs import attention_inputs, cuda, poison_allocator
from kernel_checks import assert_kernel_matches

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")]

if SM90:
    from dsflash.plugins.csa2_sparse_attention import kernel as attn_kernel
    from dsflash.plugins.csa2_sparse_attention import reference as attn_ref

BF16 = torch.bfloat16
GLUON = {"GLUON": True}


@pytest.mark.parametrize("s", [1, 3, 20, 64, 67, 130])
def test_gluon_attention_flash_sizes(gen, s):
    """1 and 3 rows (ten splits of one 64-key block: GLUON forced where the decode blocks are the
    default), 20 (3 splits of up to 4 blocks, the last window block ragged), 64 / 67 / 130 (one
    split: every block, the finished rows written by the kernel)."""
    args = attention_inputs(gen, s)
    poison_allocator()
    got = attn_kernel.SparseAttentionLauncher(overrides=GLUON)(*cuda(*args))
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, BF16, f"gluon attention, {s} rows")


@pytest.mark.parametrize("s", [4, 8, 15])
def test_default_launch_takes_gluon_from_gluon_rows(gen, s):
    """From splits.GLUON_ROWS rows the default launch is the Gluon kernel (gluon_split_count's
    splits: 16 / 8 / 4 at 4 / 8 / 15 rows on 132 SMs), below it the decode blocks."""
    args = attention_inputs(gen, s)
    launcher = attn_kernel.SparseAttentionLauncher()
    q = cuda(args[0])[0]
    assert launcher._config(q)[0]["GLUON"] and not launcher._config(q[:, :3])[0]["GLUON"]
    poison_allocator()
    got = launcher(*cuda(*args))
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, BF16, f"default launch, {s} rows")


@pytest.mark.parametrize("s", [2, 3, 20, 32])
def test_gluon_attention_normed_partials(gen, s):
    """NORMED_PARTS: the split programs divide their partial by its sum and write it in 16 bits
    through the unsplit form's store, the combine weighs it back (2 / 3 / 20 / 32 rows: 11 / 11 /
    3 / 2 splits on 132 SMs; the last row has no key at all, so each of its splits has l = 0 and
    writes zeros). Also the same launch with fp32 partials, to the same rule."""
    args = attention_inputs(gen, s)
    args[2][0, -1] = -1
    args[4][0, -1] = False
    for over in ({"NORMED_PARTS": True, "GLUON": True}, GLUON):
        poison_allocator()
        got = attn_kernel.SparseAttentionLauncher(overrides=over)(*cuda(*args))
        assert torch.count_nonzero(got[0, -1]) == 0, over
        assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, BF16, f"gluon {over}, {s} rows")


@pytest.mark.parametrize("s", [3, 67])
def test_gluon_attention_unsplit(gen, s):
    """n_split 1: the softmax partition hands the final max and sum to the accumulating one, which
    writes the finished rows (no combine launch)."""
    args = attention_inputs(gen, s)
    poison_allocator()
    got = attn_kernel.SparseAttentionLauncher(overrides=GLUON)(*cuda(*args), n_split=1)
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, BF16, f"gluon unsplit, {s} rows")


@pytest.mark.parametrize("k,t,dtype", [(200, 5, BF16), (64, 0, BF16), (7, 70, torch.float16),
                                       (513, 64, BF16)])
def test_gluon_attention_several_sequences_ragged(gen, k, t, dtype):
    """Four sequences of two rows, each with its own entries: key lists that end inside a block
    (200, 513, 7), a full block (64), windows of 0-70 keys; ids of -1
    (no key) mixed in; fp16 as well as bf16."""
    b, s, n, d = 4, 2, 3001, 512
    q = torch.randn(b, s, 64, d, generator=gen).to(dtype)
    kv = torch.randn(b, n, d, generator=gen).to(dtype)
    idx = torch.randint(-1, n, (b, s, k), generator=gen)
    win = torch.randn(b, t, d, generator=gen).to(dtype)
    wmask = torch.rand(b, s, t, generator=gen) > 0.3
    sink = torch.randn(64, generator=gen)
    args = (q, kv, idx, win, wmask, sink, d ** -0.5)
    poison_allocator()
    got = attn_kernel.SparseAttentionLauncher(overrides=GLUON)(*cuda(*args))
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, dtype,
                          f"gluon attention, {b} sequences, {k} picks, window {t}")


@pytest.mark.parametrize("keys,stages", [(32, 2), (32, 3), (32, 4)])
@pytest.mark.parametrize("s,n_split", [(3, None), (20, None), (67, 1)])
def test_gluon_attention_in_more_smaller_stages(gen, keys, stages, s, n_split):
    """GLUON_KB / GLUON_STAGES: 32-key blocks in 2-4 stages (the prologue starts that many
    gathers; splits shorter than the stages start fewer), split (3 and 20 rows) and unsplit (67
    rows, the result staged through the key stages)."""
    args = attention_inputs(gen, s)
    poison_allocator()
    over = GLUON | {"GLUON_KB": keys, "GLUON_STAGES": stages}
    got = attn_kernel.SparseAttentionLauncher(overrides=over)(*cuda(*args), n_split=n_split)
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, BF16,
                          f"gluon attention, {keys}-key blocks x {stages} stages, {s} rows")


def test_gluon_attention_four_stages_ragged(gen):
    """32-key blocks in 4 stages over sequences of their own entries: key lists ending inside a
    block, ids of -1, a window of 70 keys, fp16."""
    b, s, n, d, k, t = 4, 2, 3001, 512, 200, 70
    q = torch.randn(b, s, 64, d, generator=gen).half()
    kv = torch.randn(b, n, d, generator=gen).half()
    args = (q, kv, torch.randint(-1, n, (b, s, k), generator=gen), torch.randn(b, t, d, generator=gen).half(),
            torch.rand(b, s, t, generator=gen) > 0.3, torch.randn(64, generator=gen), d ** -0.5)
    poison_allocator()
    over = GLUON | {"GLUON_KB": 32, "GLUON_STAGES": 4}
    got = attn_kernel.SparseAttentionLauncher(overrides=over)(*cuda(*args))
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, torch.float16,
                          "gluon attention, 32-key blocks x 4 stages, ragged")


def test_gluon_attention_smaller_heads_dim(gen):
    """head_dim 256: each warpgroup's half of the accumulator is 128 columns."""
    b, s, n, d, t = 2, 5, 900, 256, 40
    args = (torch.randn(b, s, 64, d, generator=gen).to(BF16), torch.randn(b, n, d, generator=gen).to(BF16),
            torch.randint(-1, n, (b, s, 300), generator=gen), torch.randn(b, t, d, generator=gen).to(BF16),
            torch.rand(b, s, t, generator=gen) > 0.5, torch.randn(64, generator=gen), d ** -0.5)
    poison_allocator()
    got = attn_kernel.SparseAttentionLauncher(overrides=GLUON)(*cuda(*args))
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, BF16, "gluon, head_dim 256")


def test_batch_shapes_gluon_cannot_compile_take_the_triton_form(gen):
    """64 heads of 384 dims at 20 rows: the batch form, whose Gluon kernel does not compile for a
    non-power-of-two head_dim; the default launch takes the Triton batch form."""
    b, s, n, d, t = 4, 5, 700, 384, 40
    args = (torch.randn(b, s, 64, d, generator=gen).to(BF16), torch.randn(b, n, d, generator=gen).to(BF16),
            torch.randint(-1, n, (b, s, 200), generator=gen), torch.randn(b, t, d, generator=gen).to(BF16),
            torch.rand(b, s, t, generator=gen) > 0.5, torch.randn(64, generator=gen), d ** -0.5)
    poison_allocator()
    got = attn_kernel.SparseAttentionLauncher()(*cuda(*args))
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, BF16, "default launch, head_dim 384")


def test_gluon_attention_refuses_other_shapes(gen):
    q = torch.randn(1, 1, 32, 512, device="cuda", dtype=BF16)
    kv = torch.randn(1, 10, 512, device="cuda", dtype=BF16)
    idx = torch.zeros(1, 1, 4, dtype=torch.int64, device="cuda")
    win = torch.randn(1, 2, 512, device="cuda", dtype=BF16)
    wmask = torch.ones(1, 1, 2, dtype=torch.bool, device="cuda")
    sink = torch.zeros(32, device="cuda")
    with pytest.raises(ValueError, match="GLUON takes 64 heads"):
        attn_kernel.SparseAttentionLauncher(overrides=GLUON)(q, kv, idx, win, wmask, sink, 0.1)
    q384, kv384, win384 = (torch.randn(*shape, device="cuda", dtype=BF16)
                           for shape in ((1, 1, 64, 384), (1, 10, 384), (1, 2, 384)))
    with pytest.raises(ValueError, match="GLUON takes head_dim 64, 128, 256 or 512"):
        attn_kernel.SparseAttentionLauncher(overrides=GLUON)(q384, kv384, idx, win384, wmask,
                                                             torch.zeros(64, device="cuda"), 0.1)
    with pytest.raises(ValueError, match="GLUON takes bf16 or fp16"):
        attn_kernel.SparseAttentionLauncher(overrides=GLUON)(
            torch.randn(1, 1, 64, 512, device="cuda"), kv.float(), idx, win.float(), wmask,
            torch.zeros(64, device="cuda"), 0.1)


def test_gluon_attention_under_graph_replay(gen):
    """Captured once in a CUDA graph (as the runtime captures a decode step) at 32 rows (two
    splits, then the combine launch), replayed over fresh inputs copied into the captured
    tensors: each replay matches the reference for its inputs."""
    args = cuda(*attention_inputs(gen, 32))
    launcher = attn_kernel.SparseAttentionLauncher()
    launcher(*args)  # compile and allocate the workspace outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = launcher(*args)
    for _ in range(2):
        fresh = attention_inputs(gen, 32)
        for dst, src in zip(args[:6], fresh[:6], strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert_kernel_matches(out.clone(), attn_ref.csa2_sparse_attention, fresh, {}, BF16, "gluon replay")


def test_gluon_attention_launched_behind_the_topk_that_writes_its_ids(gen):
    """PDL ({"PDL": True}; off by default for the Gluon form): the Gluon launch may start while
    the top-k's rank launch before it still writes the ids it reads. Captured as a decode step is
    (top-k, then attention; 32 rows: two splits, then the combine), and replayed over fresh
    scores, so that ids read too early would be the last replay's: each replay matches the
    reference on the ids the top-k returned, and equals, bit for bit, the same chain with PDL
    off."""
    from dsflash.plugins.stable_topk.kernel import StableTopkLauncher

    rows, n = 32, 5000
    q, kv, _, win, wmask, sink, scale = cuda(*attention_inputs(gen, rows, n=n))
    scores = torch.randn(1, rows, n, generator=gen).cuda()
    chains = {}
    for pdl in (True, False):
        topk = StableTopkLauncher(overrides={"PDL": pdl})
        attention = attn_kernel.SparseAttentionLauncher(overrides={"PDL": pdl})
        assert attention._config(q)[0]["GLUON"]
        attention(q, kv, topk(scores, 512)[1], win, wmask, sink, scale)  # compile, workspaces
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ids = topk(scores, 512)[1]
            out = attention(q, kv, ids, win, wmask, sink, scale)
        chains[pdl] = (graph, ids, out)
    for step in range(3):
        scores.copy_(torch.randn(1, rows, n, generator=gen))
        got = {}
        for pdl, (graph, ids, out) in chains.items():
            graph.replay()
            torch.cuda.synchronize()
            got[pdl] = (ids.clone(), out.clone())
        assert torch.equal(got[True][0], got[False][0]), f"replay {step}: the top-k's ids"
        assert torch.equal(got[True][1], got[False][1]), f"replay {step}: PDL on and off differ"
        args = (q.cpu(), kv.cpu(), got[True][0].cpu(), win.cpu(), wmask.cpu(), sink.cpu(), scale)
        assert_kernel_matches(got[True][1], attn_ref.csa2_sparse_attention, args, {}, BF16,
                              f"behind the top-k, replay {step}")


@pytest.mark.parametrize("over,gluon_pdl", [({}, False), ({"PDL": True}, True), ({"PDL": False}, False)])
def test_gluon_launch_takes_pdl_only_when_asked(gen, monkeypatch, over, gluon_pdl):
    """By default the Gluon launch goes without PDL (kernel.gluon_launch_pdl: it measured slower)
    while the combine after it keeps PDL; {"PDL": True} launches both with it, {"PDL": False}
    neither. 16 rows: the Gluon split form, then the combine."""
    seen = {}
    for name in ("_launch_gluon", "_launch_combine"):
        launch = getattr(attn_kernel, name)

        def spy(*args, launch=launch, name=name):
            seen[name] = next(a for a in args if isinstance(a, dict) and "PDL" in a)
            return launch(*args)

        monkeypatch.setattr(attn_kernel, name, spy)
    args = attention_inputs(gen, 16)
    got = attn_kernel.SparseAttentionLauncher(overrides=over)(*cuda(*args))
    assert seen["_launch_gluon"] == ({"PDL": True, "launch_pdl": True} if gluon_pdl else {"PDL": False})
    assert seen["_launch_combine"]["PDL"] is over.get("PDL", True)
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, BF16, f"16 rows, {over}")
