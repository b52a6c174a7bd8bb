"""scripts/attention_ablation.py on the CPU: its refusals, before any GPU work (the timing itself
needs a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "attention_ablation.py"


@pytest.mark.parametrize("args,message", [
    (["--attn-over", "GLUON"], "--attn-over: 'GLUON' is not KEY=VALUE"),
    (["--attn-over", "BLOCK_M=64"], "--attn-over: 'BLOCK_M' is not a sparse attention override"),
])
def test_bad_overrides_are_refused_by_name(args, message):
    bad = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                         check=False)
    assert bad.returncode != 0 and message in bad.stderr, bad.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so():
    run = subprocess.run([sys.executable, str(SCRIPT), "--attn-over", "GLUON=True"], capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr, run.stderr[-2000:]

