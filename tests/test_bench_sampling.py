"""scripts/bench_sampling.py on the CPU: every row shape and sampling kind timed, the fast
candidates checked against the spec inside the run, the JSON the GPU run writes."""

from __future__ import annotations

import json

from conftest import run_script


def run(*args, check=True):
    return run_script("bench_sampling.py", *args, check=check)


def test_cpu_run_times_every_kind_and_batch(tmp_path):
    run("--out", str(tmp_path), "--vocab", "3000", "--batches", "1,3", "--reps", "1")
    data = json.loads((tmp_path / "bench_sampling.json").read_text())
    assert data["meta"]["vocab"] == 3000
    assert len(data["rows"]) == 12 and {r["shape"] for r in data["rows"]} == {"peaked", "middling", "flat"}
    for r in data["rows"]:
        assert min(r["fast_ms"], r["spec_ms"], r["former_ms"], r["one_pass_ms"]) > 0
        assert 1 <= r["candidates"] <= 3000
        if r["kind"] == "top-k 50":  # fp32 normal rows: no ties at the 50th
            assert r["candidates"] == 50
        if r["kind"] == "top-k 50 + top-p 0.9":
            assert r["candidates"] <= 50
    assert [b["batch"] for b in data["batches"]] == [1, 3] and data["batches"][0]["select_ms"] > 0


def test_bad_arguments_name_the_value():
    bad = run("--out", "/tmp/unused", "--vocab", "1", check=False)
    assert bad.returncode != 0 and "--vocab 1 must be >= 2" in bad.stderr
