"""scripts/attention_timeline.py on the CPU: its stamps still fit the Gluon kernel's source (the
instrumented copy builds for sm_90, with every stamp in it), and its refusals. The timing itself
needs a Hopper GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "attention_timeline.py"
sys.path.insert(0, str(ROOT / "scripts"))

import attention_timeline as timeline  # noqa: E402

BUILD = """
import json, sys, tempfile
from pathlib import Path
import torch
sys.path.insert(0, sys.argv[1])
import attention_timeline as timeline
from dsflash.plugins.aot import compile_kernel
from dsflash.plugins.csa2_sparse_attention.trt import kernel_signature
split, keys, stages = sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
with tempfile.TemporaryDirectory() as tmp:
    mod = timeline.load_instrumented(Path(tmp))
    types = {"tb_ptr": "*i64"} | kernel_signature(torch.bfloat16)
    consts = {"H": 64, "D": 512, "SCALE": 512 ** -0.5, "KB": keys, "STAGES": stages, "SPLIT": split,
              "num_warps": 8}
    pointers = tuple(a for a, t in types.items() if t.startswith("*"))
    c = compile_kernel(mod.csa2_sparse_attention_ws_kernel, types, consts, 8, divisible_by_16=pointers,
                       maxnreg=mod.MAXNREG)
    print(json.dumps({"clock_reads": c.asm["ptx"].count("%clock64"), "warps": c.metadata.num_warps}))
"""


def test_every_anchor_is_in_the_kernel_once():
    source = timeline.KERNEL.read_text()
    stamped = timeline.instrumented_source(source)
    calls = re.findall(r"^\s+(_stamp|_tick)\(tb_ptr", stamped, re.MULTILINE)
    assert calls.count("_stamp") == len(timeline.POINTS) and calls.count("_tick") == len(timeline.TICKS)


def test_a_changed_kernel_is_refused_with_the_anchor():
    source = timeline.KERNEL.read_text().replace("def _accumulate(q_ptr,", "def _accumulate_v2(q_ptr,")
    with pytest.raises(ValueError, match=r"anchor found 0 times .*_accumulate\(q_ptr"):
        timeline.instrumented_source(source)


@pytest.mark.slow
@pytest.mark.parametrize("split,keys,stages", [(True, 64, 2), (False, 64, 2), (False, 32, 4)])
def test_the_stamped_kernel_builds_for_sm90(split, keys, stages):
    pytest.importorskip("triton.experimental.gluon", reason="needs Triton with Gluon (3.5+)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = [str(ROOT / "scripts"), "1" if split else "0", str(keys), str(stages)]
    run = subprocess.run([sys.executable, "-c", BUILD, *argv], env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.strip().splitlines()[-1])
    assert built["warps"] == 12
    # each point and tick reads the clock at one place in the code (the ticks sit in the loops)
    assert built["clock_reads"] == len(timeline.POINTS) + len(timeline.TICKS)


@pytest.mark.parametrize("text,message", [
    ("64", "'64' is not ROWSxSPLITS"),
    ("0x1", "'0x1' is not ROWSxSPLITS"),
    ("64x0", "'64x0' is not ROWSxSPLITS"),
    ("4096x2", "makes 8192 programs; the stamp buffer holds 4096"),
])
def test_bad_cases_are_refused_by_name(text, message):
    with pytest.raises(ValueError, match=message):
        timeline.parse_cases(text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so():
    run = subprocess.run([sys.executable, str(SCRIPT), "--cases", "16x1"], capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr, run.stderr[-2000:]


def test_block_steps_read_the_two_stage_cycle():
    # blocks 0-3 of 16 rows unsplit on an H100 (session 35, docs/benchmarks.md): the period is the
    # cycle over two blocks, refill issue + copies + logits + softmax + hand-over + p V, halved
    blocks = dict(zip(timeline.TICKS, (
        [1.66, 3.46, 5.44, 7.41], [2.37, 4.29, 6.27, 8.24], [2.86, 4.84, 6.81, 8.78],
        [2.95, 4.93, 6.89, 8.87], [3.74, 5.72, 7.69, 9.66], [4.37, 6.30, 8.27, 10.24])))
    steps = timeline.block_steps(blocks)
    assert steps["logits"] == pytest.approx(0.83) and steps["softmax"] == pytest.approx(0.54)
    assert steps["p_v"] == pytest.approx(0.79) and steps["hand_over"] == pytest.approx(0.09)
    assert steps["refill_issue"] == pytest.approx(0.605) and steps["copies_land"] == pytest.approx(1.09)
    assert steps["period"] == pytest.approx(1.97)
    cycle = sum(steps[k] for k in ("refill_issue", "copies_land", "logits", "softmax", "hand_over", "p_v"))
    assert cycle / 2 == pytest.approx(steps["period"], rel=0.03)


def test_block_steps_read_the_refill_stages_ahead():
    """With 4 stages the refill after block i fills block i + 4: the copies' landing is read
    against that block, and the last 4 blocks refill nothing."""
    ready = [float(i) for i in range(8)]
    blocks = dict(zip(timeline.TICKS, (ready, [r + 0.3 for r in ready], [r + 0.5 for r in ready],
                                       [r + 0.55 for r in ready], [r + 0.8 for r in ready],
                                       [r + 0.9 for r in ready])))
    steps = timeline.block_steps(blocks, stages=4)
    assert steps["refill_issue"] == pytest.approx(0.1) and steps["copies_land"] == pytest.approx(3.1)
    assert steps["period"] == pytest.approx(1.0)
    assert timeline.block_steps(blocks, stages=8)["copies_land"] is None


def test_key_blocks_that_do_not_fit_are_refused_by_name():
    run = subprocess.run([sys.executable, str(SCRIPT), "--cases", "16x1", "--keys", "64", "--stages", "3"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode != 0 and "--keys 64 --stages 3" in run.stderr and "232448" in run.stderr, \
        run.stderr[-2000:]


def test_block_steps_of_a_one_block_program_leave_the_cycle_out():
    steps = timeline.block_steps({name: [float(k)] for k, name in enumerate(timeline.TICKS)})
    assert steps["logits"] == 1.0 and steps["refill_issue"] is None and steps["period"] is None


@pytest.mark.parametrize("split,per,n_blocks,expected", [(0, 4, 10, 4), (2, 4, 10, 2), (3, 3, 10, 1),
                                                         (0, 10, 10, 10), (4, 2, 8, 0)])
def test_a_rows_last_split_runs_the_blocks_left(split, per, n_blocks, expected):
    assert timeline.program_blocks(split, per, n_blocks) == expected
