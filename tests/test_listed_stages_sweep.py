"""scripts/listed_stages_sweep.py's arguments, on any machine (its timing needs a CUDA GPU:
docs/benchmarks.md, session 43, has the command)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_script


@pytest.mark.parametrize("args,message", [
    (("--rows", "8,0"), "--rows must be >= 1, got 8,0"),
    (("--kernels", "fp4,fp8"), "--kernels: unknown ['fp8'], known ['fp4', 'bf16', 'probe']"),
    (("--settings", "5:8,5"), "--settings: each is STAGES:BLOCKS[:rREGS], got '5'"),
    (("--settings", "5:8:128"), "--settings: each is STAGES:BLOCKS[:rREGS], got '5:8:128'"),
    (("--settings", "0:8"), "--settings: STAGES and BLOCKS must be >= 1, got '0:8'"),
    (("--repeat", "0"), "--repeat must be >= 1, got 0"),
])
def test_bad_arguments_name_the_value(args, message):
    bad = run_script("listed_stages_sweep.py", "--out", "/tmp/unused", *args, check=False)
    assert bad.returncode != 0 and message in bad.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_a_gpu():
    bad = run_script("listed_stages_sweep.py", "--out", "/tmp/unused", "--settings", "5:8:r0,3:16:r128",
                     check=False)
    assert bad.returncode != 0 and "needs a CUDA GPU" in bad.stderr
