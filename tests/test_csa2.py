"""CSA2 selection semantics on the tiny model (ARCHITECTURE.md §10 test 5)."""

import torch

from dsflash.model import csa2_ops as ops
from dsflash.model.attention import StepShared
from dsflash.model.cache import ModelCache
from dsflash.plugins.csa2_sparse_attention.reference import csa2_sparse_attention

from conftest import random_ids


def traced_forward(model, ids):
    trace = StepShared(used_topk={})
    with torch.no_grad():
        model(ids, trace=trace)
    return trace


def test_reindex_inside_candidate_pool_and_reuse_copies_source(tiny_model, gen):
    cfg = tiny_model.cfg
    ids = random_ids(gen, 2, 37, cfg.vocab_size)
    trace = traced_forward(tiny_model, ids)
    cand = trace.candidates_BSN
    for layer, role in enumerate(cfg.layer_roles):
        used = trace.used_topk[layer]
        if role == "window":
            assert used is None, f"window layer {layer} read global entries"
        elif role == "reuse":
            assert torch.equal(used, trace.topk[cfg.topk_source_of(layer)]), layer
        elif cfg.uses_candidate_pool(layer):
            sel = used.clamp_min(0)
            inside = cand.gather(2, sel) | (used < 0)
            assert inside.all(), f"reindex layer {layer} selected outside the pool"
            assert (used >= 0).sum() > 0


def test_newest_block_always_kept(tiny_model, gen):
    cfg = tiny_model.cfg
    ids = random_ids(gen, 1, 37, cfg.vocab_size)
    trace = traced_forward(tiny_model, ids)
    m, blk = cfg.layer_ratio(cfg.candidate_source_layer_id), cfg.candidate_block_size
    src = trace.entries[cfg.candidate_source_layer_id]
    for t in range(37):
        newest = (t + 1) // m - 1
        in_newest_block = (src.group_BN[0] // blk == newest // blk) & (src.group_BN[0] >= 0) \
            & (src.group_BN[0] <= newest)
        assert trace.candidates_BSN[0, t][in_newest_block].all(), t
        vis = (src.group_BN[0] >= 0) & (src.group_BN[0] <= newest)
        pooled = trace.candidates_BSN[0, t] & vis
        blocks = set((src.group_BN[0][pooled] // blk).tolist())
        n_vis_blocks = len(set((src.group_BN[0][vis] // blk).tolist()))
        if n_vis_blocks <= cfg.candidate_topk_blocks:
            assert torch.equal(pooled, vis), t  # a short context keeps everything visible
        else:
            assert len(blocks) == cfg.candidate_topk_blocks, t


def test_candidate_pool_keeps_newest_block_even_when_it_scores_lowest():
    scores = torch.tensor([[[9.0, 8.0, 7.0, 6.0, 5.0, 4.0, -5.0, float("-inf")]]])
    group = torch.arange(8).unsqueeze(0)
    group[0, 7] = -1
    pos = torch.tensor([[6]])  # ratio 1: entries 0..6 visible, newest = 6 (block 3 of size 2)
    keep = ops.candidate_pool(scores, group, pos, ratio=1, block=2, topk_blocks=2)
    assert keep[0, 0, :7].tolist() == [True, True, False, False, False, False, True]  # 7 is empty


def test_short_context_selects_every_visible_entry(tiny_model, gen):
    cfg = tiny_model.cfg
    n = 7  # the ratio-2 source has at most 3 visible entries here, under top-k 4
    ids = random_ids(gen, 1, n, cfg.vocab_size)
    trace = traced_forward(tiny_model, ids)
    src = cfg.kv_source_layer_ids[0]
    assert cfg.layer_ratio(src) == 2
    for t in range(n):
        visible = (t + 1) // 2
        sel = trace.used_topk[src][0, t]
        groups = trace.entries[src].group_BN[0][sel[sel >= 0]]
        assert sorted(groups.tolist()) == list(range(visible)), t
        assert (sel >= 0).sum().item() == min(visible, cfg.index_topk)


def test_window_layers_never_read_global_entries(tiny_model, gen):
    cfg = tiny_model.cfg
    ids = random_ids(gen, 1, 20, cfg.vocab_size)
    outputs = {}
    def keep_output(module, args, out):
        outputs[len(outputs)] = out[0].clone()

    hook = tiny_model.layers[0].attn.register_forward_hook(keep_output)
    try:
        for poison in (False, True):
            cache = ModelCache.allocate(cfg, 1, 32)
            tiny_model.prefill(ids[:, :19], cache, mode="exact")
            if poison:
                for src in cfg.kv_source_layer_ids:
                    cache.tensors[f"kv.{src}"].fill_(float("nan"))
                    cache.tensors[f"index_k.{src}"].fill_(float("nan"))
            outputs.clear()
            tiny_model.decoder_step(ids[:, 19:], cache)
            if not poison:
                clean = outputs[0]
    finally:
        hook.remove()
    assert torch.isfinite(outputs[0]).all() and torch.equal(outputs[0], clean)


def test_sparse_attention_sink_and_empty_selection():
    """With no keys at all the sink takes all the mass (output 0); a -inf sink is plain softmax."""
    q = torch.randn(1, 1, 2, 4)
    kv = torch.randn(1, 3, 4)
    idx = torch.tensor([[[2, 0, -1]]])
    win = torch.randn(1, 2, 4)
    mask = torch.tensor([[[True, False]]])
    no_sink = torch.full((2,), float("-inf"))
    out = csa2_sparse_attention(q, kv, idx, win, mask, no_sink, 0.5)
    keys = torch.stack([kv[0, 2], kv[0, 0], win[0, 0]])
    p = torch.softmax(q[0, 0] @ keys.t() * 0.5, dim=-1)
    assert torch.allclose(out[0, 0], p @ keys, atol=1e-6)
    empty = csa2_sparse_attention(q, kv, torch.full((1, 1, 3), -1), win, ~mask & False,
                                 torch.zeros(2), 0.5)
    assert torch.equal(empty, torch.zeros_like(empty))


def test_listed_pool_selects_what_the_mask_selects(tiny_model, gen):
    """OpSet(pool_form="list") scores only the pooled entries and ranks the list: every layer's
    selection and the logits are bit-identical to the mask form's, over a prefill of two sequences
    and decode steps after it (pools crossing the short-context regime)."""
    cfg = tiny_model.cfg
    ids = random_ids(gen, 2, 37, cfg.vocab_size)
    runs = {}
    saved = tiny_model.ops.pool_form
    try:
        for form in ("mask", "list"):
            tiny_model.ops.pool_form = form
            trace = traced_forward(tiny_model, ids)
            cache = ModelCache.allocate(cfg, 2, 48)
            with torch.no_grad():
                tiny_model.prefill(ids[:, :30], cache, mode="exact")
                steps = [tiny_model.decoder_step(ids[:, t:t + 1], cache) for t in range(30, 37)]
            runs[form] = (trace, steps)
    finally:
        tiny_model.ops.pool_form = saved
    (mask_trace, mask_steps), (list_trace, list_steps) = runs["mask"], runs["list"]
    assert list_trace.candidates_BSN is None and list_trace.candidate_list_BSP is not None
    pooled = [layer for layer in range(cfg.num_hidden_layers) if cfg.uses_candidate_pool(layer)]
    assert pooled, "the tiny config has no Reindex layer inside the pool"
    for layer, used in mask_trace.used_topk.items():
        if used is not None:
            assert torch.equal(list_trace.used_topk[layer], used), layer
    for a, b in zip(mask_steps, list_steps):
        assert torch.equal(a, b)


def test_pool_entry_list_is_the_mask_in_index_order():
    member = torch.tensor([[[False, True, True, False, True, False, False, True]],
                           [[False] * 8]])
    got = ops.pool_entry_list(member, 5)
    assert got.dtype == torch.int32
    assert got.is_contiguous()  # each Reindex layer's launches read it as it is, with no copy
    assert got.tolist() == [[[1, 2, 4, 7, -1]], [[-1] * 5]]


def test_listed_topk_breaks_ties_as_the_masked_topk():
    """Equal scores rank by entry id in both forms; fewer pooled entries than k pad with -1, to the
    mask form's min(k, N) columns even when the list is shorter than k."""
    gen = torch.Generator().manual_seed(5)
    n = 40
    scores = torch.randint(0, 4, (2, 3, n), generator=gen).float()  # many ties
    member = torch.rand(2, 3, n, generator=gen) > 0.5
    member[1, 2] = False
    member[1, 2, [3, 17]] = True  # two pooled entries, under k
    masked = scores.masked_fill(~member, float("-inf"))
    entries = ops.pool_entry_list(member, int(member.sum(-1).max()))
    listed = masked.gather(2, entries.long().clamp_min(0)).masked_fill(entries < 0, float("-inf"))
    for k in (5, 30):
        want = ops.select_topk(masked, k)
        got = ops.select_listed_topk(listed, entries, k, n)
        assert torch.equal(got, want), k
    short = ops.pool_entry_list(member, 32)[..., :3]  # P = 3 < k = 6 <= N: padded to 6 columns
    member_short = torch.zeros_like(member).scatter(2, short.long().clamp_min(0), short >= 0)
    masked = scores.masked_fill(~member_short, float("-inf"))
    listed = masked.gather(2, short.long().clamp_min(0)).masked_fill(short < 0, float("-inf"))
    assert torch.equal(ops.select_listed_topk(listed, short, 6, n), ops.select_topk(masked, 6))
