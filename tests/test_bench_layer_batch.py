"""scripts/bench_layer_batch.py on the CPU: its byte accounting (what bounds each layer's speed-up
over the dense roofline) and its refusals; the timings themselves run on the H200 only."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_layer_batch.py"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import bench_layer_batch
    return bench_layer_batch


def test_layer_bytes_grow_with_the_batch_and_bound_the_speed_ups(bench):
    ctx, pooled = 131072, 2048 * 8
    one, many = bench.layer_bytes(1, ctx, pooled), bench.layer_bytes(32, ctx, pooled)
    assert all(many[name] == 32 * one[name] for name in one)
    assert one["dense"] == ctx * 512 * 2
    # the best each layer can do against the dense roofline, from bytes alone: bf16 index keys
    # (256 B + a mask byte + an fp32 score per entry against 1 KB of KV) stay under 4x, the
    # release's FP4 keys (68 B) allow the 3x target, a 16K-entry pool and the attention's 640
    # rows leave far more than the 15x target
    best = {"full": one["dense"] / (one["index"] + one["topk"] + one["attn"]),
            "full_fp4": one["dense"] / (one["index_fp4"] + one["topk"] + one["attn"]),
            "reindex": one["dense"] / (one["index_reindex"] + one["topk"] + one["attn"]),
            "reuse": one["dense"] / one["attn"]}
    assert 3.0 < best["full"] < 4.0
    assert 10.0 < best["full_fp4"] < 15.0
    assert best["reindex"] > 15.0 and best["reuse"] > 150.0


@pytest.mark.parametrize("args, message", [
    (["--batches", "0"], "must be >= 1"),
    (["--contexts", "1001"], "multiples of 8"),
    (["--fp4-configs", "64:4:4"], "FP4 config '64:4:4' is not BLOCK_N:BLOCKS:num_warps:STAGES"),
    (["--fp4-configs", "64:4:4:0:x"], "is not BLOCK_N:BLOCKS:num_warps:STAGES[:b][:s|:n][:rREGS]"),
    (["--fp4-configs", "64:4:4:0:rx"], "is not BLOCK_N:BLOCKS:num_warps:STAGES[:b][:s|:n][:rREGS]"),
    (["--attn-configs", "64:32:8"], "attention config '64:32:8' is not BLOCK_H:BLOCK_K:num_warps:num_stages"),
    (["--attn-configs", "64:32:8:0"], "is not BLOCK_H:BLOCK_K:num_warps:num_stages[:SPLITS][:a][:pN]"),
    (["--attn-configs", "64:32:8:4:a:a"], "attention config '64:32:8:4:a:a' is not"),
    (["--attn-configs", "64:32:8:4:px"], "attention config '64:32:8:4:px' is not"),
    (["--attn-prefetch", "2,-1"], "--attn-prefetch '2,-1' is not comma-separated ints, each 0 or a power"),
    (["--attn-prefetch", "3"], "--attn-prefetch '3' is not"),
    (["--attn-configs", "64:32:8:4:p3"], "attention config '64:32:8:4:p3' is not"),
    (["--topk-digits", "8-8-8"], "digit widths (8, 8, 8) must be 1..11 bits each and add up to 32"),
    (["--topk-digits", "16-16"], "digit widths (16, 16) must be"),
    (["--topk-over", "TIES"], "--topk-over: 'TIES' is not KEY=VALUE"),
    (["--topk-over", "ties=chunk"], "--topk-over: 'ties' is not a top-k override"),
    (["--topk-over", "TIES="], "--topk-over: 'TIES=' is not KEY=VALUE"),
    (["--topk-kinds", "full,mask"], "--topk-kinds: 'full,mask' is not a list of full, reindex, listed"),
    (["--attn-over", "PDL"], "--attn-over: 'PDL' is not KEY=VALUE"),
    (["--attn-over", "TIES=chunk"], "--attn-over: 'TIES' is not a sparse-attention override"),
])
def test_bad_sizes_are_refused_by_name(tmp_path, args, message):
    bad = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), *args], capture_output=True,
                         text=True, cwd=ROOT, check=False)
    assert bad.returncode != 0 and message in bad.stderr


def test_without_a_gpu_it_says_so(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    bad = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True,
                         text=True, cwd=ROOT, check=False)
    assert bad.returncode != 0 and "needs a GPU" in bad.stderr


def test_sweep_settings_spell_out_the_launches(bench):
    configs = "decode,64:4:4:0:r80,128:16:8:3:b,128:16:4:3:s:r128,128:8:4:3:n,128:8:4:3:r0"
    assert bench.parse_fp4_configs(configs) == [
        {"PATH": "decode"},
        {"BLOCK_N": 64, "BLOCKS": 4, "num_warps": 4, "STAGES": 0, "maxnreg": 80},
        {"BLOCK_N": 128, "BLOCKS": 16, "num_warps": 8, "STAGES": 3, "EXP_WORDS": False},
        {"BLOCK_N": 128, "BLOCKS": 16, "num_warps": 4, "STAGES": 3, "LO_SKIP": True, "maxnreg": 128},
        {"BLOCK_N": 128, "BLOCKS": 8, "num_warps": 4, "STAGES": 3, "LO_SKIP": False},
        {"BLOCK_N": 128, "BLOCKS": 8, "num_warps": 4, "STAGES": 3, "maxnreg": None}]  # r0: no cap
    for bad in ("128:8:4:3:x", "128:8:4:3:s:n"):
        with pytest.raises(ValueError, match="is not BLOCK_N:BLOCKS:num_warps:STAGES"):
            bench.parse_fp4_configs(bad)
    assert bench.parse_fp4_configs("") == []
    settings = bench.topk_settings([2048], [(4, 4, 8, 8, 8)])
    assert settings == {"chunk 2048 warps 4": {"CHUNK": 2048, "num_warps": 4, "SKIP_IDLE": True},
                        "chunk 2048 warps 4 no skip": {"CHUNK": 2048, "num_warps": 4, "SKIP_IDLE": False},
                        "chunk 2048 warps 8": {"CHUNK": 2048, "num_warps": 8, "SKIP_IDLE": True},
                        "digits 4-4-8-8-8": {"DIGITS": (4, 4, 8, 8, 8)}}
    # --topk-blocks: the radix form against the block-max form at each block size
    assert bench.topk_settings([], [], [8, 32]) == {
        "radix form": {"FORM": "radix"},
        "block-max form, blocks of 8": {"FORM": "prefilter", "BLOCK": 8},
        "block-max form, blocks of 32": {"FORM": "prefilter", "BLOCK": 32}}
    # --topk-ranks: whole chunks against live blocks in the collect launch, then each rank block
    assert bench.topk_settings([], [], ranks=[4, 64]) == {
        "collect chunk": {"COLLECT": "chunk"}, "collect live": {"COLLECT": "live"},
        "collect live, rank block 4": {"COLLECT": "live", "RANK_BLOCK": 4},
        "collect live, rank block 64": {"COLLECT": "live", "RANK_BLOCK": 64}}
    # --topk-first: the block-max form's first launch at each count of blocks per program
    assert bench.topk_settings([], [], firsts=[32, 512]) == {
        "first launch, 32 blocks per program": {"FORM": "prefilter", "BM_CHUNK": 32},
        "first launch, 512 blocks per program": {"FORM": "prefilter", "BM_CHUNK": 512}}
    # --topk-ties: the ties at T in programs of their own against in the rank programs
    assert bench.topk_settings([], [], ties=True) == {
        "ties in programs of their own": {"FORM": "prefilter", "TIES": "chunk"},
        "ties in the rank programs": {"FORM": "prefilter", "TIES": "rank"}}
    # --topk-sweep: the defaults first, then each set of overrides under its own text
    custom = [bench.parse_overrides(item, option="--topk-sweep")
              for item in ("PASS_LAUNCH=each", "RANK_COVER=1,PASS_WARPS=4")]
    assert bench.topk_settings([], [], custom=custom) == {
        "defaults": {}, "PASS_LAUNCH=each": {"PASS_LAUNCH": "each"},
        "RANK_COVER=1,PASS_WARPS=4": {"RANK_COVER": 1, "PASS_WARPS": 4}}
    with pytest.raises(ValueError, match="--topk-sweep: 'PASSES' is not a top-k override"):
        bench.parse_overrides("PASSES=3", option="--topk-sweep")
    # --topk-over: the layer table's top-k launcher overrides
    assert bench.parse_overrides("TIES=chunk,RANK_BLOCK=16,PDL=False,num_warps=8") == {
        "TIES": "chunk", "RANK_BLOCK": 16, "PDL": False, "num_warps": 8}
    assert bench.parse_overrides("") == {}
    assert bench.parse_attn_configs("16:32:4:3,64:16:8:2:5,64:32:8:4:a,64:16:8:8:2:a:p4") == [
        {"BLOCK_H": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3},
        {"BLOCK_H": 64, "BLOCK_K": 16, "num_warps": 8, "num_stages": 2, "n_split": 5},
        {"BLOCK_H": 64, "BLOCK_K": 32, "num_warps": 8, "num_stages": 4, "INDEX_AHEAD": True},
        {"BLOCK_H": 64, "BLOCK_K": 16, "num_warps": 8, "num_stages": 8, "n_split": 2, "INDEX_AHEAD": True,
         "PREFETCH": 4}]
    # --attn-prefetch: each distance over the launcher default, or over each config
    assert bench.with_prefetch([], "0,4") == [{"PREFETCH": 0}, {"PREFETCH": 4}]
    assert bench.with_prefetch([{"BLOCK_K": 32}], "2") == [{"BLOCK_K": 32, "PREFETCH": 2}]
    assert bench.with_prefetch([{"BLOCK_K": 32}], "") == [{"BLOCK_K": 32}]


def test_the_figure_redraws_from_a_saved_run_without_a_gpu(tmp_path):
    """--plot-from draws a saved run's figure (the H200 run of session 27 in docs/) on any machine;
    a missing file is refused, naming it."""
    saved = ROOT / "docs" / "bench_layer_batch_topk_live_h200_2026-12-05.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--plot-from", str(saved)],
                         capture_output=True, text=True, cwd=ROOT, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    png = tmp_path / (saved.stem + ".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    bad = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--plot-from",
                          str(tmp_path / "none.json")], capture_output=True, text=True, cwd=ROOT, check=False)
    assert bad.returncode != 0 and "no file" in bad.stderr and "none.json" in bad.stderr


def test_an_attention_setting_that_does_not_fit_is_a_result(bench, monkeypatch):
    """A sweep setting whose kernel needs more shared memory than the GPU has (64-key blocks of
    64 x 512 heads in 3 stages: 256 KB, as on the H100 in session 30) is recorded as NaN with the
    error, and the settings after it are still timed and compared (the launcher and the timer
    stand in for the GPU's)."""
    from triton.runtime.errors import OutOfResources

    class Launcher:
        def __init__(self, overrides=None):
            self.overrides = overrides or {}

        def __call__(self, q, *rest, n_split=None):
            if self.overrides.get("num_stages") == 3:
                raise OutOfResources(262144, 232448, "shared memory")
            return q + self.overrides.get("BLOCK_K", 0) * 1e-3  # a rounding-sized difference

    monkeypatch.setattr(bench, "layer_inputs", lambda batch, ctx, gen: {
        name: torch.zeros(batch, 4) for name in ("q", "kv", "idx", "win", "wmask", "sink")})
    monkeypatch.setattr(bench.attn_kernel, "SparseAttentionLauncher", Launcher)
    monkeypatch.setattr(bench, "time_ms", lambda fn, graph: (fn(), 0.02)[1])
    got = bench.attn_sweep(2, 1024, None, [{"BLOCK_K": 64, "num_stages": 3}, {"BLOCK_K": 8, "num_stages": 2}])
    assert list(got) == ["launcher default", "BLOCK_K 64 num_stages 3", "BLOCK_K 8 num_stages 2"]
    assert math.isnan(got["BLOCK_K 64 num_stages 3"]["us"])
    assert "shared memory" in got["BLOCK_K 64 num_stages 3"]["error"]
    assert got["BLOCK_K 8 num_stages 2"] == {"us": pytest.approx(20.0), "max_abs_diff": pytest.approx(8e-3)}


@pytest.mark.parametrize("queries", ["qat", "bf16"])
def test_fp4_sweep_scores_the_chosen_queries(monkeypatch, bench, queries):
    """--fp4-queries: the FP4 index kernels get kv_qat's rounded queries (the model's) or the bf16
    ones, in the sweep as in the layer table."""
    inputs = {name: torch.full((2, 3), float(i)) for i, name in enumerate(("iq", "iq_qat", "iw", "codes",
                                                                           "exps", "all", "list"))}
    seen = []

    def score(q, *rest, overrides=None):
        seen.append(q)
        return torch.ones(2, 3)

    monkeypatch.setattr(bench, "layer_inputs", lambda batch, ctx, gen: inputs)
    monkeypatch.setattr(bench.index_kernel, "csa2_index_score_fp4", score)
    monkeypatch.setattr(bench, "csa2_index_score_fp4_pooled", score)
    monkeypatch.setattr(bench, "time_ms", lambda fn, graph: (fn(), 0.01)[1])
    got = bench.fp4_sweep(2, 1024, None, [{"BLOCK_N": 128}], queries)
    assert got["BLOCK_N 128"] == {"us": pytest.approx(10.0), "max_rel_diff": 0.0}
    want = inputs[bench.FP4_QUERIES[queries]]
    assert len(seen) == 6 and all(q is want for q in seen)  # default, config, timed; mask and list
    assert bench.FP4_QUERIES == {"qat": "iq_qat", "bf16": "iq"}
    report = bench.report({"gpu": "G", "torch": "t", "triton": "tr", "date": "d", "bw_GBps": 1.0,
                           "fp4_queries": queries, "cases": []})
    assert f"FP4 layers' index queries: {queries}" in report


@pytest.mark.parametrize("fp4", [False, True])
def test_listed_selection_takes_the_index_maxima_when_asked(bench, gen, fp4):
    """select_listed (the listed Reindex layer's selection, as OpSet("triton") runs it): with the
    top-k's INDEX_MAXIMA the index launch writes the block maxima and the top-k takes them, the
    same entry ids as without; both the bf16 and the FP4 index keys (16 heads: the FP8 path)."""
    from dsflash.model import csa2_ops
    from dsflash.model.quant import fp4_pow2_pack
    from dsflash.plugins.launch import interpreting
    from dsflash.plugins.stable_topk.kernel import StableTopkLauncher

    rows, n, p, heads, dim = 2, 3000, 1100, 16, 32
    member = torch.zeros(rows, 1, n, dtype=torch.bool)
    for r in range(rows):
        member[r, 0, torch.randperm(n, generator=gen)[:p - 40 * r]] = True
    mag = torch.randint(1, 256, (rows, 1, heads, dim), generator=gen) / 64.0  # exact FP8 parts
    q = (mag * torch.where(torch.rand(rows, 1, heads, dim, generator=gen) < 0.5, -1.0, 1.0))
    keys = torch.randn(rows, n, dim, generator=gen)
    codes, exps = fp4_pow2_pack(keys)
    x = {"list": csa2_ops.pool_entry_list(member, p), "iq": q, "iq_qat": q, "ik": keys, "codes": codes,
         "exps": exps, "iw": torch.randn(rows, 1, heads, generator=gen)}
    if not interpreting():
        x = {name: t.cuda() for name, t in x.items()}
        x["iq"] = x["iq_qat"] = q.to(torch.bfloat16).cuda()
        x["ik"] = keys.to(torch.bfloat16).cuda()
    over = {"FORM": "prefilter", "BLOCK": 2}
    with_maxima = StableTopkLauncher(overrides=over | {"INDEX_MAXIMA": True})
    assert with_maxima.maxima_block(rows, p, bench.TOPK) == 2
    calls = []
    take = with_maxima.listed_ids_with_maxima
    with_maxima.listed_ids_with_maxima = lambda *args: calls.append(1) or take(*args)
    got = bench.select_listed(with_maxima, x, fp4, "iq_qat", n)
    want = bench.select_listed(StableTopkLauncher(overrides=over), x, fp4, "iq_qat", n)
    assert calls and torch.equal(got, want)
