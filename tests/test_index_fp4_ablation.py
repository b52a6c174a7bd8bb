"""scripts/index_fp4_ablation.py's argument check and byte counts, on any machine (its timing needs
a CUDA GPU: scripts/gpu_check.sh runs it there)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import run_script


def test_bad_rows_name_the_value():
    bad = run_script("index_fp4_ablation.py", "--out", "/tmp/unused", "--rows", "8,0", check=False)
    assert bad.returncode != 0 and "--rows must be >= 1, got 8,0" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu():
    bad = run_script("index_fp4_ablation.py", "--out", "/tmp/unused", check=False)
    assert bad.returncode != 0 and "needs a CUDA GPU" in bad.stderr


def test_rooflines_count_the_layer_table_bytes_and_the_sector_padding():
    """The counted roofline is bench_layer_batch.py's listed FP4 index bytes; a random slot's key
    adds 28 bytes in whole 32-byte sectors (codes: 64 in two; the 4-byte exponent word: one)."""
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    sys.path.insert(0, scripts)
    try:
        import index_fp4_ablation
        from bench_layer_batch import layer_bytes
    finally:
        sys.path.remove(scripts)
    assert index_fp4_ablation.sector_padding(128) == 28
    slots = index_fp4_ablation.slots()
    assert slots == 16384
    gbps = 1000.0
    roof = index_fp4_ablation.rooflines_us(64, gbps)
    counted = layer_bytes(64, index_fp4_ablation.ENTRIES, slots)["index_listed_fp4"]
    assert roof["counted"] == counted / gbps / 1e3
    assert roof["sectors"] - roof["counted"] == pytest.approx(64 * slots * 28 / gbps / 1e3, rel=1e-12)


def test_gather_probe_meets_its_reference(gen):
    """The gather-only probe (listed_key_gather_kernel: the listed FP4 kernel's bytes without its
    products) gives its PyTorch reference's XOR of each listed key's words, 0 for ids outside
    [0, N), over blocks and runs that end inside the list (interpreter on the CPU)."""
    scripts = str(Path(__file__).resolve().parents[1] / "scripts")
    sys.path.insert(0, scripts)
    try:
        import index_fp4_ablation
    finally:
        sys.path.remove(scripts)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, n, p = 3, 300, 150
    codes = torch.randint(0, 256, (rows, n, 64), generator=gen, dtype=torch.uint8).view(torch.int32)
    exps = torch.randint(-128, 128, (rows, n, 4), generator=gen, dtype=torch.int8).view(torch.int32)
    ids = torch.randint(-3, n + 3, (rows, p), generator=gen, dtype=torch.int32)
    args = (codes.to(device), exps.view(rows, n).to(device), ids.to(device),
            {"BLOCK_N": 32, "BLOCKS": 2, "STAGES": 2})
    got = index_fp4_ablation.listed_key_gather(*args)
    want = index_fp4_ablation.listed_key_gather_reference(*args)
    assert torch.equal(got, want) and bool((want != 0).any())
