"""The kernels a TensorRT engine would embed, run as TensorRT runs them (plugins/ptx_launch.py): each
plugin's aot_launch for concrete shapes, its PTX loaded by the CUDA driver, launched with that
grid and its extra arguments between the input and output pointers, every output poisoned (NaN)
beforehand and checked against the reference by the §7 rule. Every tactic, and both pointer
assumptions (aligned, the build's default, and not). Needs a CUDA GPU (sm_90 PTX)."""

from __future__ import annotations

import pytest
import torch
from gpu_inputs import attention_inputs, cuda, engram_inputs, mhc_inputs
from kernel_checks import assert_kernel_matches

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    from dsflash.plugins.csa2_index_score import reference as index_ref
    from dsflash.plugins.csa2_index_score import trt as index_trt
    from dsflash.plugins.csa2_sparse_attention import reference as attn_ref
    from dsflash.plugins.csa2_sparse_attention import splits as attn_splits
    from dsflash.plugins.csa2_sparse_attention import trt as attn_trt
    from dsflash.plugins.csa2_sparse_attention import trt_split as attn_split_trt
    from dsflash.plugins.engram_hash_gather import reference as engram_ref
    from dsflash.plugins.engram_hash_gather import trt as engram_trt
    from dsflash.plugins.mhc_boundary import reference as mhc_ref
    from dsflash.plugins.mhc_boundary import splits as mhc_splits
    from dsflash.plugins.mhc_boundary import trt as mhc_trt
    from dsflash.plugins.mhc_boundary import trt_split as mhc_split_trt
    from dsflash.plugins.ptx_launch import PtxKernel

BF16 = torch.bfloat16


def nan_outputs(*specs):
    return [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for shape, dtype in specs]


def run(launch, inputs, outputs):
    with PtxKernel(launch) as kernel:
        kernel(launch, inputs, outputs)
        torch.cuda.synchronize()
    return outputs


@pytest.mark.parametrize("tactic", [1, 2])
@pytest.mark.parametrize("s,n", [(1, 131075), (5, 4099)])
def test_aot_index_score_tactics(gen, tactic, s, n):
    q = torch.randn(1, s, 32, 128, generator=gen).to(BF16)
    w = torch.randn(1, s, 32, generator=gen)
    k = torch.randn(1, n, 128, generator=gen).to(BF16)
    visible = torch.rand(1, s, n, generator=gen) > 0.2
    launch = index_trt.aot_launch(tuple(q.shape), tuple(k.shape), BF16, tactic)
    (out,) = run(launch, cuda(q, w, k, visible), nan_outputs(((1, s, n), torch.float32)))
    assert_kernel_matches(out, index_ref.csa2_index_score, (q, w, k, visible), {}, BF16,
                          f"index tactic {tactic}")


@pytest.mark.parametrize("tactic", [1, 2])
@pytest.mark.parametrize("s,n", [(1, 131075), (5, 4099)])
def test_aot_index_score_fp4_tactics(gen, tactic, s, n):
    """kv_qat's FP4 index keys (Csa2IndexScoreFp4, trt_fp4.py): the decode and FP8 tactics, 64
    heads x 128 as in the release, exponents read as bytes."""
    from dsflash.model.quant import fp4_pow2_pack
    from dsflash.plugins.csa2_index_score import trt_fp4

    q = torch.randn(1, s, 64, 128, generator=gen).to(BF16)
    w = torch.randn(1, s, 64, generator=gen)
    codes, exps = fp4_pow2_pack(torch.randn(1, n, 128, generator=gen))
    visible = torch.rand(1, s, n, generator=gen) > 0.2
    launch = trt_fp4.aot_launch(tuple(q.shape), tuple(codes.shape), BF16, tactic)
    (out,) = run(launch, cuda(q, w, codes, exps, visible), nan_outputs(((1, s, n), torch.float32)))
    assert_kernel_matches(out, index_ref.csa2_index_score_fp4, (q, w, codes, exps, visible), {}, BF16,
                          f"fp4 index tactic {tactic}")


@pytest.mark.parametrize("s,k,n", [(1, 512, 32771), (5, 37, 300)])
def test_aot_entries_fp4(gen, s, k, n):
    """kv_qat's FP4 entries (Csa2EntriesFp4, trt_entries_fp4.py) at the release's head_dim 512:
    the selected rows decoded bit for bit as the reference, ids of -1 as zero rows."""
    from dsflash.model.quant import fp4_e4m3scale_pack
    from dsflash.plugins.csa2_sparse_attention import trt_entries_fp4

    codes, scales = fp4_e4m3scale_pack(torch.randn(2, n, 512, generator=gen))
    idx = torch.randint(-1, n, (2, s, k), generator=gen)
    q = torch.zeros(2, s, 1, 512, dtype=BF16)
    launch = trt_entries_fp4.aot_launch(tuple(codes.shape), tuple(idx.shape), BF16)
    (out,) = run(launch, cuda(q, codes, scales, idx), nan_outputs(((2, s * k, 512), BF16)))
    assert torch.equal(out.cpu(), attn_ref.csa2_entries_fp4(q, codes, scales, idx))


def test_aot_index_score_fp32_unaligned(gen):
    """fp32 queries and keys (tactic 1 only) from a kernel compiled for any pointer alignment, run
    on keys that start 4 bytes into their buffer."""
    q = torch.randn(2, 3, 20, 72, generator=gen)
    w = torch.randn(2, 3, 20, generator=gen)
    k = torch.randn(2, 1 + 999 * 72, generator=gen)[:, 1:].reshape(2, 999, 72)
    visible = torch.rand(2, 3, 999, generator=gen) > 0.5
    assert index_trt.tactics(torch.float32, 72) == [index_trt.ONE_BLOCK]
    launch = index_trt.aot_launch(tuple(q.shape), tuple(k.shape), torch.float32, aligned=False)
    keys = torch.randn(2 * 999 * 72 + 1, device="cuda")[1:]  # 4-byte aligned, not 16
    keys.copy_(k.reshape(-1).cuda())
    (out,) = run(launch, [*cuda(q, w), keys, visible.cuda()], nan_outputs(((2, 3, 999), torch.float32)))
    assert_kernel_matches(out, index_ref.csa2_index_score, (q, w, k, visible), {}, torch.float32,
                          "index fp32")
    aligned = index_trt.aot_launch(tuple(q.shape), tuple(k.shape), torch.float32)
    with PtxKernel(aligned) as kernel, pytest.raises(ValueError, match="not 16-byte aligned"):
        kernel(aligned, [*cuda(q, w), keys, visible.cuda()], nan_outputs(((2, 3, 999), torch.float32)))


@pytest.mark.parametrize("tactic,aligned", [(1, True), (2, True), (3, True), (4, True), (1, False)])
@pytest.mark.parametrize("s", [1, 3, 40])
def test_aot_sparse_attention(gen, s, tactic, aligned):
    """Every tactic as TensorRT launches it, 4 being the Gluon kernel (12 warps, .maxnreg 168,
    214 KB of shared memory) unsplit."""
    if tactic == 4 and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon tactic is sm_90 code (wgmma, setmaxnreg)")
    args = attention_inputs(gen, s)
    q, kv, idx, win, mask, sink, scale = args
    launch = attn_trt.aot_launch(q.shape, kv.shape, idx.shape, win.shape, BF16, scale, aligned=aligned,
                                 tactic=tactic)
    (out,) = run(launch, cuda(q, kv, idx, win, mask, sink), nan_outputs((tuple(q.shape), BF16)))
    assert_kernel_matches(out, attn_ref.csa2_sparse_attention, args, {}, BF16, "sparse attention (AOT)")


@pytest.mark.parametrize("tactic", [1, 2, 3])
@pytest.mark.parametrize("s", [1, 8, 70])
def test_aot_split_attention(gen, s, tactic):
    """decoder_step's two attention nodes: the split kernel's partials against their reference
    (1 row: 21 splits of one key block; 8 rows: 7 splits of 3 blocks; 70 rows: one split), then
    the combine kernel on them against the one-node reference, in both its tactics. Tactic 3 is
    the Gluon kernel over the same plan (12 warps, 32-key blocks in 4 stages)."""
    if tactic == 3 and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon tactic is sm_90 code (wgmma, setmaxnreg)")
    args = attention_inputs(gen, s)
    q, kv, idx, win, mask, sink, scale = args
    attrs = attn_splits.export_attrs(64, 512)
    split = attn_split_trt.aot_launch_split(q.shape, kv.shape, idx.shape, win.shape, BF16, scale, **attrs,
                                            tactic=tactic)
    _, acc_shape, ml_shape = attn_split_trt.split_outputs(q.shape, idx.shape, win.shape, **attrs)
    assert split.grid[2] == acc_shape[2] == {1: 21, 8: 7, 70: 1}[s]
    acc, ml = run(split, cuda(q, kv, idx, win, mask, sink),
                  nan_outputs((acc_shape, torch.float32), (ml_shape, torch.float32)))
    assert_kernel_matches((acc, ml), attn_ref.csa2_sparse_attention_split, args, attrs, BF16,
                          "sparse attention split (AOT)")
    for combine_tactic in attn_split_trt.combine_tactics():  # one load, chunks of 4 splits
        combine = attn_split_trt.aot_launch_combine(q.shape, acc_shape, BF16, tactic=combine_tactic)
        (out,) = run(combine, [*cuda(q), acc, ml, sink.cuda()], nan_outputs((tuple(q.shape), BF16)))
        assert_kernel_matches(out, attn_ref.csa2_sparse_attention, args, {}, BF16,
                              f"split + combine (AOT, combine tactic {combine_tactic})")


@pytest.mark.parametrize("batch", [5, 70])
def test_aot_attention_at_decoder_steps_shapes(gen, batch):
    """decoder_step's shapes: `batch` sequences of one row each, every sequence over its own
    entries and window (the tests above run one sequence of s rows). The one-node attention in
    every tactic (`--decode-attention single` exports it) and the split pair in every split and
    combine tactic (the default export), against the one-node reference."""
    gluon = torch.cuda.get_device_capability() == (9, 0)
    args = attention_inputs(gen, 1, n=3001, batch=batch)
    q, kv, idx, win, mask, sink, scale = args
    inputs = cuda(q, kv, idx, win, mask, sink)
    for tactic in attn_trt.tactics(BF16, 64, 512) if gluon else [1, 2, 3]:
        launch = attn_trt.aot_launch(q.shape, kv.shape, idx.shape, win.shape, BF16, scale, tactic=tactic)
        (out,) = run(launch, inputs, nan_outputs((tuple(q.shape), BF16)))
        assert_kernel_matches(out, attn_ref.csa2_sparse_attention, args, {}, BF16,
                              f"one node, tactic {tactic}, batch {batch}")
    attrs = attn_splits.export_attrs(64, 512)
    _, acc_shape, ml_shape = attn_split_trt.split_outputs(q.shape, idx.shape, win.shape, **attrs)
    for tactic in attn_split_trt.tactics(BF16, 64, 512, attrs["block_keys"]) if gluon else [1, 2]:
        split = attn_split_trt.aot_launch_split(q.shape, kv.shape, idx.shape, win.shape, BF16, scale, **attrs,
                                                tactic=tactic)
        acc, ml = run(split, inputs, nan_outputs((acc_shape, torch.float32), (ml_shape, torch.float32)))
        for combine_tactic in attn_split_trt.combine_tactics():
            combine = attn_split_trt.aot_launch_combine(q.shape, acc_shape, BF16, tactic=combine_tactic)
            (out,) = run(combine, [*cuda(q), acc, ml, sink.cuda()], nan_outputs((tuple(q.shape), BF16)))
            assert_kernel_matches(out, attn_ref.csa2_sparse_attention, args, {}, BF16,
                                  f"split {tactic} + combine {combine_tactic}, batch {batch}")


@pytest.mark.parametrize("batch,new", [(1, 1), (2, 4099)])
def test_aot_engram_gather(gen, batch, new):
    cids, rows, mult, primes, offsets = engram_inputs(gen, batch, new)
    table = torch.randn(rows, 256, generator=gen).to(BF16)
    launch = engram_trt.aot_launch(tuple(cids.shape), tuple(table.shape), BF16, mult, primes, offsets, 3, 8)
    (out,) = run(launch, cuda(cids, table), nan_outputs(((batch, new, 24, 256), BF16)))
    assert torch.equal(out.cpu(), engram_ref.engram_hash_gather(cids, table, mult, primes, offsets, 3, 8))


@pytest.mark.parametrize("tactic", [1, 2, 3])
@pytest.mark.parametrize("tokens", [1, 300])
def test_aot_mhc_boundary(gen, tokens, tactic):
    """Tactic 3 runs clusters of 8 CTAs that exchange their sums through the outputs."""
    args = mhc_inputs(gen, tokens)
    attrs = {"iters": 20, "hc_eps": 1e-6, "rms_eps": 1e-6}
    launch = mhc_trt.aot_launch(tuple(args[0].shape), BF16, **attrs, tactic=tactic)
    c, e = args[0].shape[2:]
    outs = nan_outputs((tuple(args[0].shape), BF16), ((1, tokens, e), BF16), ((1, tokens, c), torch.float32),
                       ((1, tokens, c), torch.float32), ((1, tokens, c, c), torch.float32))
    run(launch, cuda(*args), outs)
    assert_kernel_matches(tuple(outs), mhc_ref.mhc_boundary, args, attrs, BF16, f"mhc (AOT) {tokens} tokens")


@pytest.mark.parametrize("partials_tactic,finish_tactic", [(1, 1), (2, 2), (3, 2), (1, 2)])
@pytest.mark.parametrize("tokens", [1, 4, 64, 300])
def test_aot_mhc_split_form(gen, tokens, partials_tactic, finish_tactic):
    """decoder_step's two mHC nodes as TensorRT runs them: the partials kernel against its
    reference (up to 16 tokens: 160 splits of one 32-channel chunk; 300 tokens: 14 splits), then the finish
    kernel on them against the one-node reference."""
    args = mhc_inputs(gen, tokens)
    site = {"iters": 20, "hc_eps": 1e-6, "rms_eps": 1e-6}
    streams = tuple(args[0].shape)
    attrs = mhc_splits.export_attrs(streams[3])
    part = mhc_split_trt.aot_launch_partials(streams, tuple(args[5].shape), BF16, **attrs,
                                             tactic=partials_tactic)
    _, n_split, shapes = mhc_split_trt.partials_outputs(streams, tuple(args[5].shape), **attrs)
    assert part.grid[1] == n_split == {1: 160, 4: 160, 64: 54, 300: 14}[tokens]
    parts = run(part, cuda(*args[:6]), nan_outputs(*zip(shapes, (BF16, BF16, torch.float32, torch.float32))))
    assert_kernel_matches(tuple(parts), mhc_ref.mhc_boundary_partials, args[:6], attrs, BF16,
                          f"mhc partials (AOT) {tokens} tokens")
    c = streams[2]
    fin = mhc_split_trt.aot_launch_finish(shapes[1], shapes[2], BF16, **site, tactic=finish_tactic)
    outs = nan_outputs((shapes[1], BF16), ((1, tokens, c), torch.float32), ((1, tokens, c), torch.float32),
                       ((1, tokens, c, c), torch.float32))
    run(fin, [*parts[1:], *cuda(*args[6:])], outs)
    assert_kernel_matches((parts[0], *outs), mhc_ref.mhc_boundary, args, site, BF16,
                          f"mhc partials + finish (AOT) {tokens} tokens")


def test_ptx_kernel_refuses_a_wrong_argument_list(gen):
    q = torch.randn(1, 1, 32, 128, device="cuda").to(BF16)
    launch = index_trt.aot_launch(tuple(q.shape), (1, 100, 128), BF16)
    with PtxKernel(launch) as kernel:
        with pytest.raises(ValueError, match="declares 7 parameters, got 3 inputs"):
            kernel(launch, [q, q, q], [q])
        host = torch.zeros(4)
        with pytest.raises(ValueError, match="parameter 1: a contiguous tensor on cuda"):
            kernel(launch, [q, host, q, q], [q])
