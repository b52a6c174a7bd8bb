"""scripts/bench_decode.py on the CPU: the plumbing the H200 run relies on (synthetic cache, the
modes' shared state, the table and the JSON), with the reference ops on the tiny preset."""

from __future__ import annotations

import json

import pytest

from conftest import run_script


def run(*args, check=True):
    return run_script("bench_decode.py", *args, check=check)


def test_cpu_run_writes_a_case_per_batch_and_context(tmp_path):
    run("--device", "cpu", "--config", "tiny", "--contexts", "24,40", "--batches", "1,3",
        "--modes", "reference", "--warmup", "1", "--steps", "2", "--out", str(tmp_path))
    data = json.loads((tmp_path / "bench_decode.json").read_text())
    assert data["meta"]["modes"] == ["reference"] and data["meta"]["copy_GBps"] > 0
    cases = {(r["batch"], r["context"]): r for r in data["results"]}
    assert set(cases) == {(1, 24), (3, 24), (1, 40), (3, 40)}
    for r in cases.values():
        m = r["modes"]["reference"]
        assert m["ms"] > 0 and m["tokens_per_s"] > 0 and 0 < m["roofline"] < 1
    # the cache a step reads grows with the batch and the context
    cache = {key: r["bytes"]["cache"] for key, r in cases.items()}
    assert cache[(3, 40)] > cache[(1, 40)] > cache[(1, 24)]


@pytest.mark.parametrize("mode", ["graph", "compiled", "compiled-cdt", "graph-mask"])
def test_graph_modes_need_cuda(tmp_path, mode):
    bad = run("--device", "cpu", "--config", "tiny", "--modes", mode, "--out", str(tmp_path), check=False)
    assert bad.returncode != 0 and "CUDA graphs need --device cuda" in bad.stderr
