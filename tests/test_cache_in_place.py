"""The cache feeds a run of slots as views and the generator keeps its sequences in the lowest
slots, so decode steps copy no state (runtime/cache_manager.py, runtime/generator.py)."""

import pytest
import torch

from dsflash.model.cache import ModelCache
from dsflash.model.generate import generate
from dsflash.runtime.cache_manager import CacheManager
from dsflash.runtime.engine import make_engines
from dsflash.runtime.generator import Generator
from dsflash.runtime.request import GenerationParams

from conftest import random_ids


def shares_pool(t: torch.Tensor, pool: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()


def test_feeds_are_views_for_a_run_of_slots_and_copies_otherwise(tiny_cfg):
    cm = CacheManager(tiny_cfg, 4, 32)
    names = ["ids", "swa_kv", "kv.1", "seq_len"]
    ids = torch.zeros(2, 1, dtype=torch.int64)
    for slots, in_place in (([1, 2], True), ([0, 2], False), ([2, 1], False), ([3], True)):
        assert cm.in_place(slots) is in_place
        feeds = cm.feeds(slots, names, ids[: len(slots)])
        for n in names[1:]:
            assert shares_pool(feeds[n], cm.cache.tensors[n]) is in_place, (slots, n)
    # the views are the slots' state: the ring's slot axis is the second
    feeds = cm.feeds([1, 2], names, ids)
    cm.cache.tensors["swa_kv"][:, 2] = 7.0
    assert torch.all(feeds["swa_kv"][:, 1] == 7.0) and torch.all(feeds["swa_kv"][:, 0] == 0.0)


def test_slot_errors_name_the_slots():
    from dsflash.model.config import ModelConfig

    cm = CacheManager(ModelConfig.preset("tiny"), 3, 16)
    with pytest.raises(ValueError, match=r"slot ids \[0, 3\] outside \[0, 3\)"):
        cm.feeds([0, 3], ["ids"], torch.zeros(2, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"slot ids \[1, 1\] contain duplicates"):
        cm.cache.slot_index([1, 1])
    a = cm.acquire()
    with pytest.raises(ValueError, match="slot 1 is not in use"):
        cm.move(1, 2)
    with pytest.raises(ValueError, match="slot 0 is not free"):
        cm.move(a, a)
    with pytest.raises(ValueError, match="over the cache capacity 16"):
        cm.feeds([a], ["ids"], torch.zeros(1, 17, dtype=torch.int64))


def test_acquire_hands_out_the_lowest_free_slot_and_move_copies_one_slot(tiny_cfg, gen):
    cm = CacheManager(tiny_cfg, 4, 16)
    assert [cm.acquire() for _ in range(3)] == [0, 1, 2]
    cm.release(0)
    cm.release(2)
    assert cm.lowest_free() == 0 and cm.acquire() == 0
    for v in cm.cache.tensors.values():
        v.copy_(torch.randint(0, 100, v.shape, generator=gen).to(v.dtype))
    before = {k: v.clone() for k, v in cm.cache.tensors.items()}
    cm.move(1, 2)  # 1 -> the free slot 2; slot 1 is then free and reset
    assert cm.lowest_free() == 1
    for k, v in cm.cache.tensors.items():
        moved, old = (v[:, 2], before[k][:, 1]) if k == "swa_kv" else (v[2], before[k][1])
        assert torch.equal(moved, old), k
        kept, was = (v[:, 0], before[k][:, 0]) if k == "swa_kv" else (v[0], before[k][0])
        assert torch.equal(kept, was), k
    assert int(cm.cache.seq_len[1]) == 0 and int(cm.cache.tensors["engram_hist"][1, 0]) == -1


def test_ring_and_entry_writes_match_a_per_row_loop(tiny_cfg, gen):
    """ModelCache.write puts every layer's ring rows with one indexed write and a decode step's
    entries without finding the completing rows on the host; both equal a plain per-row loop."""
    cfg, w = tiny_cfg, tiny_cfg.sliding_window
    cache = ModelCache.allocate(cfg, 3, 32)
    idx = torch.tensor([2, 0])
    src = cfg.kv_source_layer_ids[0]
    n_layers, d = cfg.num_hidden_layers, cfg.head_dim
    for rows_s in (1, 3, w + 2):
        want = {k: v.clone() for k, v in cache.tensors.items()}
        pos = torch.tensor([[5], [11]]) + torch.arange(rows_s)
        group = torch.where(pos % 2 == 1, pos // 2, torch.full_like(pos, -1))
        adds = {"swa_rows": torch.randn(n_layers, 2, rows_s, d, generator=gen), "swa_first_layer": 0,
                "pos": pos, "engram_hist": torch.randint(0, 9, (2, 3), generator=gen),
                "seq_len": pos[:, -1] + 1, f"group.{src}": group,
                f"kv.{src}": torch.randn(2, rows_s, d, generator=gen),
                f"index_k.{src}": torch.randn(2, rows_s, cfg.index_head_dim, generator=gen)}
        if f"comp_kv.{src}" in cache.tensors:
            shape = cache.tensors[f"comp_kv.{src}"].shape[1:]
            adds[f"comp_kv.{src}"] = torch.randn(2, *shape, generator=gen)
            adds[f"comp_score.{src}"] = torch.randn(2, *shape, generator=gen)
        for b, slot in enumerate(idx.tolist()):
            for s in range(rows_s):
                if s >= rows_s - w:  # only the last W rows stay in the ring
                    want["swa_kv"][:, slot, int(pos[b, s]) % w] = adds["swa_rows"][:, b, s]
                if int(group[b, s]) >= 0:
                    want[f"kv.{src}"][slot, int(group[b, s])] = adds[f"kv.{src}"][b, s]
                    want[f"index_k.{src}"][slot, int(group[b, s])] = adds[f"index_k.{src}"][b, s]
            for k in ("engram_hist", "seq_len", f"comp_kv.{src}", f"comp_score.{src}"):
                if k in adds:
                    want[k][slot] = adds[k][b]
        cache.write(adds, idx)
        for k, v in cache.tensors.items():
            assert torch.equal(v, want[k]), (rows_s, k)


def test_sequences_stay_in_the_lowest_slots_and_decode_in_place(tiny_model, gen):
    """Requests that finish early free low slots; the ones above move down, every decode batch
    is one run of slots fed as views (named resident), and each request's tokens equal its
    one-at-a-time greedy run."""
    cfg = tiny_model.cfg
    engines = make_engines("torch", model=tiny_model)
    calls = []
    step = engines["decoder_step"]
    plain_run = step.run

    def spy(feeds, resident=()):
        calls.append((feeds["ids"].shape, bool(resident),
                      shares_pool(feeds["kv.1"], g.cache.cache.tensors["kv.1"])))
        return plain_run(feeds, resident)

    step.run = spy
    g = Generator(engines, CacheManager(cfg, 3, 64))
    prompts = [random_ids(gen, 1, n, cfg.vocab_size)[0].tolist() for n in (6, 9, 4, 7)]
    lengths = [3, 9, 2, 6]
    ids = [g.add(p, GenerationParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
    slots_seen = {}
    while g.has_unfinished():
        g.step()
        for r in g.running.values():
            slots_seen.setdefault(r.request_id, set()).add(r.slot)
    assert any(len(s) > 1 for s in slots_seen.values()), "no request was moved"
    decodes = [(in_place, shared) for shape, in_place, shared in calls if shape[1] == 1]
    assert decodes and all(in_place and shared for in_place, shared in decodes)
    done = g.requests
    for rid, p, n in zip(ids, prompts, lengths):
        assert done[rid].tokens == generate(tiny_model, [p], n)[0], rid
    assert g.cache.free_slots == 3


def test_a_decode_write_into_pools_without_entries(tiny_cfg, gen):
    """Capacity 1 leaves a ratio-2 source no entries ([B, 0, D]): a decode step completes no
    group there, and the write must skip it rather than index entry 0 of an empty pool."""
    cache = ModelCache.allocate(tiny_cfg, 2, 1)
    src = tiny_cfg.kv_source_layer_ids[0]
    assert cache.tensors[f"kv.{src}"].shape[1] == 0
    d = tiny_cfg.head_dim
    adds = {"swa_rows": torch.randn(tiny_cfg.num_hidden_layers, 2, 1, d, generator=gen),
            "swa_first_layer": 0, "pos": torch.zeros(2, 1, dtype=torch.int64),
            "engram_hist": torch.zeros(2, 3, dtype=torch.int64), "seq_len": torch.ones(2, dtype=torch.int64),
            f"group.{src}": torch.full((2, 1), -1), f"kv.{src}": torch.randn(2, 1, d, generator=gen),
            f"index_k.{src}": torch.randn(2, 1, tiny_cfg.index_head_dim, generator=gen)}
    pending = cache.tensors[f"comp_kv.{src}"].shape[1:]
    adds[f"comp_kv.{src}"] = torch.randn(2, *pending, generator=gen)
    adds[f"comp_score.{src}"] = torch.randn(2, *pending, generator=gen)
    cache.write(adds, torch.tensor([1, 0]))
    assert torch.equal(cache.seq_len, torch.ones(2, dtype=torch.int64))
    assert torch.equal(cache.tensors["swa_kv"][:, 1, 0], adds["swa_rows"][:, 0, 0])
