"""The kernels on the GPU at the released sizes (bf16), with what only a GPU can check: FP8
Engram rows, a table in pinned host memory, one launch per mHC boundary, the CUDA-graph decode
step. Run on the H200 by scripts/gpu_check.sh; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from gpu_inputs import attention_inputs, cuda, engram_inputs, mhc_inputs, poison_allocator
from kernel_checks import assert_kernel_matches

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    from dsflash.plugins.csa2_index_score import kernel as index_kernel
    from dsflash.plugins.csa2_index_score import reference as index_ref
    from dsflash.plugins.csa2_sparse_attention import kernel as attn_kernel
    from dsflash.plugins.csa2_sparse_attention import reference as attn_ref
    from dsflash.plugins.engram_hash_gather import kernel as engram_kernel
    from dsflash.plugins.engram_hash_gather import reference as engram_ref
    from dsflash.plugins.mhc_boundary import kernel as mhc_kernel
    from dsflash.plugins.mhc_boundary import reference as mhc_ref

BF16 = torch.bfloat16


@pytest.mark.parametrize("batch,new", [(1, 1), (256, 1), (1, 8191)])
def test_engram_gather_flash_sizes(gen, batch, new):
    cids, rows, mult, primes, offsets = engram_inputs(gen, batch, new)
    table = torch.randn(rows, 256, generator=gen).to(BF16)
    poison_allocator()
    got = engram_kernel.engram_hash_gather(*cuda(cids, table), mult, primes, offsets, 3, 8)
    assert torch.equal(got.cpu(), engram_ref.engram_hash_gather(cids, table, mult, primes, offsets, 3, 8))


def test_engram_gather_fp8_rows_and_pinned_host_table(gen):
    cids, rows, mult, primes, offsets = engram_inputs(gen, 4, 33)
    table = (torch.randn(rows, 256, generator=gen) * 8).to(torch.float8_e4m3fn)
    scales = torch.rand(rows, generator=gen) + 0.01
    expected = engram_ref.engram_hash_gather_fp8(cids, table, scales, mult, primes, offsets, 3, 8)
    poison_allocator()
    got = engram_kernel.engram_hash_gather_fp8(*cuda(cids, table, scales), mult, primes, offsets, 3, 8)
    assert torch.equal(got.cpu(), expected)
    host = torch.randn(rows, 256, generator=gen).to(BF16).pin_memory()  # read over PCIe (UVA)
    got = engram_kernel.engram_hash_gather(cids.cuda(), host, mult, primes, offsets, 3, 8)
    assert torch.equal(got.cpu(), engram_ref.engram_hash_gather(cids, host, mult, primes, offsets, 3, 8))
    with pytest.raises(ValueError, match="table is on cpu"):
        engram_kernel.engram_hash_gather(cids.cuda(), host.clone(), mult, primes, offsets, 3, 8)


@pytest.mark.parametrize("s,n", [(1, 4099), (5, 16411), (130, 1000), (1, 131075)])
def test_index_score_flash_sizes(gen, s, n):
    """One block per program (4K, 16K) and the pipelined loop of four (130 rows, 128K entries:
    pipelined_config), each with a ragged last block."""
    q = torch.randn(1, s, 32, 128, generator=gen).to(BF16)
    w = torch.randn(1, s, 32, generator=gen)
    k = torch.randn(1, n, 128, generator=gen).to(BF16)
    visible = torch.rand(1, s, n, generator=gen) > 0.2
    poison_allocator()
    got = index_kernel.csa2_index_score(*cuda(q, w, k, visible))
    assert_kernel_matches(got, index_ref.csa2_index_score, (q, w, k, visible), {}, BF16, "index score")


@pytest.mark.parametrize("rows", [1, 40, 64])
def test_listed_pool_scores_and_picks_flash_sizes(gen, rows):
    """A Reindex layer's pool listed (OpSet("triton")'s form: 512 blocks of 8 entries of 16,411,
    the newest partial block included): the pooled kernel meets the reference, its scores are the
    mask-form kernel's bits at every listed entry (one row: 64-entry blocks; 40 rows: the pipelined
    launch; 64 rows: its key copies two blocks ahead), and the top-k over the list picks what the
    top-k over all entries picks, as two ops and as the listed top-k's one launcher call."""
    from dsflash.model import csa2_ops
    from dsflash.plugins.csa2_index_score.pooled import (
        csa2_index_score_pooled,
        csa2_index_score_pooled_maxima,
        listed_pipelined_config,
        listed_pipelined_launch,
    )
    from dsflash.plugins.stable_topk.kernel import StableTopkLauncher
    from dsflash.plugins.stable_topk.reference import block_maxima

    n, block, kept = 16411, 8, 512
    q = torch.randn(rows, 1, 32, 128, generator=gen).to(BF16)
    w = torch.randn(rows, 1, 32, generator=gen)
    k = torch.randn(rows, n, 128, generator=gen).to(BF16)
    blocks = -(-n // block)
    picks = torch.rand(rows, blocks, generator=gen).argsort(dim=1)[:, :kept]
    picks[:, 0] = blocks - 1
    pool = torch.zeros(rows, blocks, dtype=torch.bool).scatter(1, picks, True)
    member = pool.repeat_interleave(block, dim=1)[:, :n].view(rows, 1, n)
    entries = csa2_ops.pool_entry_list(member, kept * block)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if rows == 64 and sms <= 132:  # the key copies two blocks ahead (5 stages, runs of 8): H100, H200
        assert listed_pipelined_config(rows, kept * block, 128, BF16, torch.device("cuda")) == \
            listed_pipelined_launch()
    poison_allocator()
    got = csa2_index_score_pooled(*cuda(q, w, k, entries))
    assert_kernel_matches(got, index_ref.csa2_index_score_pooled, (q, w, k, entries), {}, BF16,
                          "pooled index score")
    masked = index_kernel.csa2_index_score(*cuda(q, w, k, member))
    listed = entries.cuda() >= 0
    at_list = masked.gather(2, entries.cuda().long().clamp_min(0))
    assert torch.equal(got[listed], at_list[listed])
    topk = StableTopkLauncher()
    want = csa2_ops.select_topk(masked, 512, topk=topk)
    assert torch.equal(csa2_ops.select_listed_topk(got, entries.cuda(), 512, n, topk=topk), want)
    # the model's eager form: the rank launch writes the entry ids (listed_ids; the block-max form
    # from 16 rows, its passes in one program, stopping early), and so with a launch per pass and
    # the old rank grid, in 8 warps (the default is 4 from 8 rows), with every pass over the maxima
    # run (no early stop), and with the former collect and rank widths
    for over in ({}, {"PASS_LAUNCH": "each", "RANK_COVER": 1}, {"PASS_WARPS": 8}, {"EARLY_SLACK": "off"},
                 {"COLLECT_WARPS": 4, "RANK_WARPS": 4, "CMP_BLOCK": 256}):
        ids = StableTopkLauncher(overrides=over).listed_ids(got, entries.cuda(), 512, n)
        assert torch.equal(ids, want), over
    # the index launch writing the block maxima, the top-k taking them (INDEX_MAXIMA): this list of
    # 4,096 slots takes the radix form by default (512 blocks of 8 < 4k), so the block-max form
    # over blocks of 8 is asked for
    on = {"INDEX_MAXIMA": True, "FORM": "prefilter", "BLOCK": 8}
    assert StableTopkLauncher(overrides={"INDEX_MAXIMA": True}).maxima_block(rows, kept * block, 512) == 0
    assert StableTopkLauncher(overrides=on).maxima_block(rows, kept * block, 512) == 8
    scores, maxima = csa2_index_score_pooled_maxima(*cuda(q, w, k, entries), 8)
    assert torch.equal(scores, got) and torch.equal(maxima, block_maxima(got, 8))
    for over in ({}, {"EARLY_SLACK": "off"}):
        launcher = StableTopkLauncher(overrides=on | over)
        assert torch.equal(launcher.listed_ids_with_maxima(scores, maxima, entries.cuda(), 512, n), want)


@pytest.mark.parametrize("over", [{}, {"BLOCK_N": 128, "BLOCKS": 16, "STAGES": 3}], ids=["branch", "pipelined"])
def test_listed_pool_fp4_scores_flash_sizes(gen, over):
    """The listed pool over the release's FP4 keys (pooled_fp4.py), 12 rows of 16,411 entries,
    512 blocks of 8 listed: meets the reference, and gives the mask form's FP8-path bits at every
    listed entry (the same per-entry products in the same order)."""
    from dsflash.model import csa2_ops
    from dsflash.model.quant import fp4_pow2_pack
    from dsflash.plugins.csa2_index_score.pooled_fp4 import (
        csa2_index_score_fp4_pooled,
        csa2_index_score_fp4_pooled_maxima,
    )
    from dsflash.plugins.stable_topk.reference import block_maxima

    rows, n, block, kept = 12, 16411, 8, 512
    q = torch.randn(rows, 1, 32, 128, generator=gen).to(BF16)
    w = torch.randn(rows, 1, 32, generator=gen)
    codes, exps = fp4_pow2_pack(torch.randn(rows, n, 128, generator=gen))
    blocks = -(-n // block)
    picks = torch.rand(rows, blocks, generator=gen).argsort(dim=1)[:, :kept]
    pool = torch.zeros(rows, blocks, dtype=torch.bool).scatter(1, picks, True)
    member = pool.repeat_interleave(block, dim=1)[:, :n].view(rows, 1, n)
    entries = csa2_ops.pool_entry_list(member, kept * block)
    args = (q, w, codes, exps, entries)
    poison_allocator()
    got = csa2_index_score_fp4_pooled(*cuda(*args), overrides=over)
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4_pooled, args, {}, BF16, "pooled fp4 index score")
    masked = index_kernel.csa2_index_score_fp4(*cuda(q, w, codes, exps, member), overrides={"PATH": "mma"})
    listed = entries.cuda() >= 0
    assert torch.equal(got[listed], masked.gather(2, entries.cuda().long().clamp_min(0))[listed])
    # with the block maxima the top-k takes from it (INDEX_MAXIMA): the same scores, their maxima
    scores, maxima = csa2_index_score_fp4_pooled_maxima(*cuda(*args), 8, overrides=over)
    assert torch.equal(scores, got) and torch.equal(maxima, block_maxima(got, 8))


FP4_LAUNCHES = {"decode": {"PATH": "decode"}, "mma": {"PATH": "mma"},
                "mma_pipelined": {"PATH": "mma", "BLOCK_N": 128, "BLOCKS": 16, "STAGES": 3, "num_warps": 8},
                "mma_exponent_bytes": {"PATH": "mma", "EXP_WORDS": False, "STAGES": 2}}


@pytest.mark.parametrize("path", list(FP4_LAUNCHES))
def test_index_score_fp4_keys_flash_sizes(gen, path):
    """FP4 index keys as stored in the release (32 heads x 128, 68 B per entry), random bf16
    queries, through both paths (decode to bf16 keys; FP8 tensor cores, with the branch per block
    or the pipelined loop, exponents as words or bytes)."""
    from dsflash.model.quant import fp4_pow2_pack

    q = torch.randn(1, 2, 32, 128, generator=gen).to(BF16)
    w = torch.randn(1, 2, 32, generator=gen)
    codes, exps = fp4_pow2_pack(torch.randn(1, 16411, 128, generator=gen))
    visible = torch.rand(1, 2, 16411, generator=gen) > 0.2
    args = (q, w, codes, exps, visible)
    poison_allocator()
    got = index_kernel.csa2_index_score_fp4(*cuda(*args), overrides=FP4_LAUNCHES[path])
    assert_kernel_matches(got, index_ref.csa2_index_score_fp4, args, {}, BF16, f"index scores fp4 {path}")


def test_index_score_fp4_batch_launch_is_the_one_row_launch_bit_for_bit(gen):
    """At a decode batch (rows x runs of 2,048 entries >= one per SM) the FP8 path takes the
    pipelined form (fp4_mma_config); per entry it does the same products in the same order as the
    one-row form, so the scores agree bit for bit, and both meet the reference."""
    from dsflash.model.quant import fp4_pow2_pack

    rows, n = 20, 16411
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert index_kernel.fp4_mma_config(1, 131072, torch.device("cuda"))["BLOCK_N"] == 64
    picked = index_kernel.fp4_mma_config(rows, n, torch.device("cuda"))
    assert picked.get("STAGES") == 3 or rows * 9 < sms
    q = torch.randn(rows, 1, 32, 128, generator=gen).to(BF16)
    w = torch.randn(rows, 1, 32, generator=gen)
    codes, exps = fp4_pow2_pack(torch.randn(rows, n, 128, generator=gen))
    visible = torch.rand(rows, 1, n, generator=gen) > 0.2
    args = (q, w, codes, exps, visible)
    poison_allocator()
    batch = index_kernel.csa2_index_score_fp4(*cuda(*args), overrides={"PATH": "mma"})
    one_row = index_kernel.csa2_index_score_fp4(*cuda(*args), overrides={"PATH": "mma", "BLOCK_N": 64,
                                                                        "BLOCKS": 4, "STAGES": 0})
    assert torch.equal(batch, one_row)
    assert_kernel_matches(batch, index_ref.csa2_index_score_fp4, args, {}, BF16, "index scores fp4 batch")


@pytest.mark.parametrize("gluon", [None, False])
@pytest.mark.parametrize("s", [1, 3, 20, 40, 64, 65, 67])
def test_sparse_attention_flash_sizes(gen, s, gluon):
    """Decode blocks (1, 3 rows) and the batch form, by default the warp-specialized Gluon kernel
    on an sm_90 GPU (tests/test_attention_gluon_gpu.py has its own cases); GLUON False: the Triton
    batch form, up to 64 rows 32-key blocks in 3 stages with the ids loaded ahead (20 rows: 6
    splits, 40: 3, 64: 2), then 64-key blocks in 2 stages (65 rows: 2 splits, 67: one)."""
    args = attention_inputs(gen, s)
    poison_allocator()
    over = None if gluon is None else {"GLUON": gluon}
    got = attn_kernel.SparseAttentionLauncher(overrides=over)(*cuda(*args))
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, BF16, "sparse attention")


GATHER_OPTIONS = {"prefetch 1": {"PREFETCH": 1}, "prefetch 4": {"PREFETCH": 4},
                  "prefetch 16": {"PREFETCH": 16}, "ids ahead": {"INDEX_AHEAD": True},
                  "ids ahead, prefetch 4": {"INDEX_AHEAD": True, "PREFETCH": 4}}


@pytest.mark.parametrize("s", [1, 20, 40, 67])
@pytest.mark.parametrize("option", sorted(GATHER_OPTIONS))
def test_sparse_attention_gather_options_change_no_bit(gen, s, option):
    """The L2 prefetch (PREFETCH key blocks ahead, past the split's end and into the window
    blocks) and the ids loaded a step ahead (INDEX_AHEAD) change only when bytes arrive: the same
    output, bit for bit, as the same launch without them. Decode splits of one block (1 row), the
    batch form's 32-key blocks over several splits (20, 40 rows) and its 64-key blocks unsplit
    (67 rows)."""
    args = cuda(*attention_inputs(gen, s))
    poison_allocator()
    plain = {"INDEX_AHEAD": False, "PREFETCH": 0}  # the batch form loads the ids ahead by default
    want = attn_kernel.SparseAttentionLauncher(overrides=plain)(*args)
    got = attn_kernel.SparseAttentionLauncher(overrides=plain | GATHER_OPTIONS[option])(*args)
    assert torch.equal(got, want)


@pytest.mark.parametrize("s", [20, 67])
@pytest.mark.parametrize("keys,stages", [(32, 4), (16, 8)])
def test_sparse_attention_deep_pipeline_flash_sizes(gen, s, keys, stages):
    """The batch form with the ids a step ahead and deeper pipelines (several row copies in
    flight in the selected loop) against the reference; 196 KB of shared memory."""
    args = attention_inputs(gen, s)
    poison_allocator()
    over = {"BLOCK_H": 64, "BLOCK_K": keys, "num_warps": 8, "num_stages": stages, "INDEX_AHEAD": True}
    got = attn_kernel.SparseAttentionLauncher(overrides=over)(*cuda(*args))
    assert_kernel_matches(got, attn_ref.csa2_sparse_attention, args, {}, BF16,
                          f"sparse attention, {keys}-key blocks, {stages} stages, ids ahead")


@pytest.mark.parametrize("barrier", [True, False])
@pytest.mark.parametrize("tokens,n_split", [(1, None), (7, None), (64, None), (300, None), (300, 1),
                                            (5000, None)])
def test_mhc_boundary_flash_sizes(gen, tokens, n_split, barrier):
    """Split channels (few tokens) and whole rows per program (n_split 1, and 5000 tokens); split
    blocks finish with the barrier (every split normalises its own chunks) or without it (the
    last program normalises the block)."""
    args = mhc_inputs(gen, tokens)
    attrs = dict(iters=20, hc_eps=1e-6, rms_eps=1e-6)
    launcher = mhc_kernel.MhcBoundaryLauncher(overrides={"BARRIER": barrier})
    for _ in range(3):  # later calls run on the counters the first one left
        poison_allocator()
        got = launcher(*cuda(*args), **attrs, n_split=n_split)
        assert_kernel_matches(got, mhc_ref.mhc_boundary, args, attrs, BF16, f"mhc {tokens} tokens")
    split = tokens <= 300 and n_split is None
    # the flash-size split grids fit one cooperative launch, so the barrier form ran
    assert list(launcher._fits.values()) == ([True] if barrier and split else []), launcher._fits


def test_mhc_barrier_under_graph_replay(gen):
    """The decode boundary's cooperative launch captured once as a CUDA graph (as the decode step
    is) and replayed on fresh inputs: each replay equals the reference (a stale generation or
    arrival count shows up as a hang or a wrong replay)."""
    attrs = dict(iters=20, hc_eps=1e-6, rms_eps=1e-6)
    launcher = mhc_kernel.MhcBoundaryLauncher(overrides={"BARRIER": True})  # also for one row
    for tokens in (1, 16):
        inputs = cuda(*mhc_inputs(gen, tokens))
        launcher(*inputs, **attrs)  # compile, allocate the workspace
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = launcher(*inputs, **attrs)
        for _ in range(4):
            fresh = mhc_inputs(gen, tokens)
            for dst, src in zip(inputs, fresh):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            assert_kernel_matches(tuple(o.clone() for o in outs), mhc_ref.mhc_boundary, fresh, attrs, BF16,
                                  f"mhc replay, {tokens} tokens")
    assert all(launcher._fits.values()) and len(launcher._fits) == 2, launcher._fits


def test_mhc_boundary_is_one_launch(gen):
    from torch.profiler import ProfilerActivity, profile

    args = cuda(*mhc_inputs(gen, 1))
    launcher = mhc_kernel.MhcBoundaryLauncher()
    launcher(*args, 20, 1e-6, 1e-6)  # compiles and allocates the workspace
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        launcher(*args, 20, 1e-6, 1e-6)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert kernels == ["mhc_boundary_kernel"], kernels


def decode_attention_inputs(gen, n=131072):
    """One decode row at the released sizes: 512 selected entries + the 128-key window."""
    return (torch.randn(1, 1, 64, 512, generator=gen).to(BF16),
            torch.randn(1, n, 512, generator=gen).to(BF16), torch.randint(-1, n, (1, 1, 512), generator=gen),
            torch.randn(1, 128, 512, generator=gen).to(BF16), torch.rand(1, 1, 128, generator=gen) > 0.1,
            torch.randn(64, generator=gen), 512 ** -0.5)


TOPK_FORMS = {"radix": {"FORM": "radix"}, "prefilter": {"FORM": "prefilter"},
              "prefilter, whole chunks": {"FORM": "prefilter", "COLLECT": "chunk"}, "default": {}}


@pytest.mark.parametrize("form", list(TOPK_FORMS))
def test_workspace_kernels_under_graph_replay(gen, form):
    """The split attention and the top-k reuse their launchers' workspaces (top-k: histograms and
    counters it clears itself): captured once as a CUDA graph, as the decode step is, and
    replayed on fresh inputs, each replay equals the reference (a counter left over or a stale
    partial shows up as a wrong replay); the top-k in both forms, the block-max one with either
    collect launch (live blocks, whole chunks), and the launcher's own choice."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    attn = attn_kernel.SparseAttentionLauncher()
    topk = topk_kernel.StableTopkLauncher(overrides=TOPK_FORMS[form])
    a_in = cuda(*decode_attention_inputs(gen))
    s_in = torch.relu(torch.randn(2, 131072, device="cuda"))
    attn(*a_in), topk(s_in, 512)  # compile, allocate the workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a_out = attn(*a_in)
        v_out, i_out = topk(s_in, 512)
    for _ in range(8):
        fresh = decode_attention_inputs(gen)
        for dst, src in zip(a_in[:6], fresh[:6]):
            dst.copy_(src)
        scores = torch.relu(torch.randn(2, 131072, generator=gen)).round(decimals=2)  # many ties
        s_in.copy_(scores)
        graph.replay()
        torch.cuda.synchronize()
        assert_kernel_matches(a_out.clone(), attn_ref.csa2_sparse_attention, fresh, {}, BF16, "attn replay")
        want_v, want_i = topk_ref.stable_topk(scores, 512)
        assert torch.equal(i_out.cpu(), want_i) and torch.equal(v_out.cpu(), want_v)


def test_captured_decode_survives_a_larger_eager_call(gen):
    """The runtime captures the decode step once and keeps running prefill eagerly on the same
    launchers. An eager call that needs a larger workspace must not free the one a captured graph
    holds: capture MhcBoundary (1 token) and the split attention (1 row), grow both workspaces
    with eager calls, fill new allocations with NaN (they would take any freed block), then replay
    on fresh inputs."""
    attrs = dict(iters=20, hc_eps=1e-6, rms_eps=1e-6)
    mhc, attn = mhc_kernel.MhcBoundaryLauncher(), attn_kernel.SparseAttentionLauncher()
    m_in, a_in = cuda(*mhc_inputs(gen, 1)), cuda(*decode_attention_inputs(gen))
    mhc(*m_in, **attrs), attn(*a_in)  # compile, allocate the workspaces
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        m_out = mhc(*m_in, **attrs)
        a_out = attn(*a_in)
    mhc(*cuda(*mhc_inputs(gen, 64)), **attrs)  # 54 splits x 64 rows, 4 token blocks
    attn(*cuda(*attention_inputs(gen, 5)))  # 5 rows of splits
    torch.cuda.synchronize()
    assert mhc._retired and attn._retired  # both grew
    junk = [torch.full((n,), float("nan"), device="cuda") for n in (2, 512, 8192, 1 << 20) for _ in range(16)]
    for _ in range(3):
        m_fresh, a_fresh = mhc_inputs(gen, 1), decode_attention_inputs(gen)
        for dst, src in zip([*m_in, *a_in[:6]], [*m_fresh, *a_fresh[:6]]):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert_kernel_matches(tuple(o.clone() for o in m_out), mhc_ref.mhc_boundary, m_fresh, attrs, BF16,
                              "mhc replay after growth")
        assert_kernel_matches(a_out.clone(), attn_ref.csa2_sparse_attention, a_fresh, {}, BF16,
                              "attention replay after growth")
    del junk


@pytest.mark.parametrize("kv_qat", [False, True])
def test_cuda_graph_decode_with_kernels_gives_reference_tokens(tiny_cfg, gen, kv_qat):
    """Greedy generation through the runtime: reference ops eagerly vs Triton kernels with the
    decode step replayed as a CUDA graph, ragged batch of two prompts; also with the flash
    preset's FP8/FP4 round-trips (model/quant.py's exact exponent and rounding forms on CUDA)."""
    from dsflash.model.model import DSFlashModel
    from dsflash.runtime.cache_manager import CacheManager
    from dsflash.runtime.engine import make_engines
    from dsflash.runtime.generator import Generator
    from dsflash.runtime.request import GenerationParams

    from conftest import random_ids

    if kv_qat:
        tiny_cfg = tiny_cfg.replace(kv_qat=True, index_head_dim=32)
    prompts = [random_ids(gen, 1, n, tiny_cfg.vocab_size)[0].tolist() for n in (13, 5)]
    params = GenerationParams(max_new_tokens=12)
    runs = {}
    for backend in ("torch", "torch-triton"):
        model = DSFlashModel(tiny_cfg).init_weights(seed=1234).eval().cuda()
        engines = make_engines(backend, model=model)
        g = Generator(engines, CacheManager(tiny_cfg, 2, 64, device="cuda"))
        ids = [g.add(p, params) for p in prompts]
        done = g.run()
        runs[backend] = [done[i].tokens for i in ids]
        if backend == "torch-triton":
            # decode steps only: batch 2, then batch 1 after the shorter request finishes
            assert 1 <= engines["decoder_step"]._graphed.captured <= 2
    assert runs["torch-triton"] == runs["torch"]


@pytest.mark.parametrize("pdl", [True, False])
@pytest.mark.parametrize("rows,n,k", [(1, 131072, 512), (4, 65536, 512), (1, 16384, 2048), (2, 3000, 512),
                                      (64, 16384, 512), (128, 16384, 512), (64, 131072, 512)])
@pytest.mark.parametrize("form", list(TOPK_FORMS))
def test_stable_topk_flash_sizes(gen, rows, n, k, pdl, form):
    """Bit-exact against the stable sort at decode sizes, with many exact ties (ReLU zeros), with
    programmatic dependent launch (the default on sm_90) and without (64 rows of 16K: a Reindex
    layer's listed pools at a decode batch; 64 of 128K: Full layers'), in both forms (the
    block-max one falls back to the radix one where a row has fewer than k blocks; its collect
    launch over the live blocks, the default, and over whole chunks; the launcher's own choice,
    blocks of 8 on the 16K rows from 16 rows). A third of the zeros are -0.0, which tie with +0.0."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    scores = torch.relu(torch.randn(rows, n, generator=gen))
    scores[:, ::3] = torch.where(scores[:, ::3] == 0, -0.0, scores[:, ::3])
    scores[:, : n // 3] = float("-inf")
    want_v, want_i = topk_ref.stable_topk(scores, k)
    launcher = topk_kernel.StableTopkLauncher(overrides={"PDL": pdl} | TOPK_FORMS[form])
    for _ in range(2):
        poison_allocator()
        got_v, got_i = launcher(scores.cuda(), k)
        assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v)


def test_stable_topk_live_blocks_follow_the_builds_registers(gen, monkeypatch):
    """The live collect's blocks a step from the real sm_90 builds (LIVE_BLOCKS="rounds": warmup
    and their register counts): 8 rows of 128K (1,024 collect programs) keep 32 blocks a step; at
    64 rows (4,096) the 32-block build (more registers a thread) fits fewer programs than the
    8-block one and not all 4,096 in about one round, so the launcher takes fewer blocks a step.
    Bit-exact either way."""
    from dsflash.plugins.stable_topk import kernel as topk_kernel
    from dsflash.plugins.stable_topk import reference as topk_ref

    picks = []
    rule = topk_kernel.live_blocks_for
    monkeypatch.setattr(topk_kernel, "live_blocks_for", lambda *a: picks.append(rule(*a)) or picks[-1])
    launcher = topk_kernel.StableTopkLauncher(overrides={"LIVE_BLOCKS": "rounds"})
    for rows in (8, 64):
        scores = torch.relu(torch.randn(rows, 131072, generator=gen)).round(decimals=2)
        want_v, want_i = topk_ref.stable_topk(scores, 512)
        poison_allocator()
        got_v, got_i = launcher(scores.cuda(), 512)
        assert torch.equal(got_i.cpu(), want_i) and torch.equal(got_v.cpu(), want_v), rows
    assert picks[0] == 32 and picks[1] < 32, picks
    # the 64-row configuration: the only one whose 32-block build did not fit, so 16 was built too
    (key,) = {key for key, blocks in launcher._resident if blocks == 16}
    resident = {blocks: launcher._resident[key, blocks] for blocks in (32, 16, 8) if (key, blocks) in launcher._resident}
    assert resident[32] < resident[16] and 4096 > 1.15 * resident[32], resident
