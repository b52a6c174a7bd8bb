"""scripts/bench_listed_fp4.py's argument checks, on any machine (its timing needs an sm_90 GPU:
scripts/gpu_check.sh runs it there)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_script


def run(*args):
    return run_script("bench_listed_fp4.py", "--out", "/tmp/unused", *args, check=False)


def test_bad_arguments_name_the_value():
    bad = run("--rows", "8,0")
    assert bad.returncode != 0 and "--rows must be >= 1, got 8,0" in bad.stderr
    bad = run("--configs", "64:16:6,64:x")
    assert bad.returncode != 0 and "--configs item '64:x' is not BLOCK_N:BLOCKS:STAGES" in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu():
    bad = run("--rows", "8")
    assert bad.returncode != 0 and "needs a CUDA GPU" in bad.stderr
