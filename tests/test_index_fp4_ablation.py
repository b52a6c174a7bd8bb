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


def test_a_random_slot_moves_three_sectors():
    """The counted bytes are bench_layer_batch.py's (76 per slot); a random slot's key touches two
    32-byte sectors of codes and one of exponents, 104 bytes with its id and score."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import index_fp4_ablation
    finally:
        sys.path.pop(0)
    assert index_fp4_ablation.slot_bytes() == {"counted": 76, "sectors": 104}
