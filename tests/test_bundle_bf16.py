"""bfloat16 bundles: exported by scripts/export.py --dtype bfloat16 through worker processes
(which once exported float32 graphs under a bfloat16 manifest), loaded back by the torch
backend bit for bit, and refused by ONNX Runtime's CPU provider with a reason."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsflash.export.bundle import Bundle, BundleError
from dsflash.export.contract import graph_outputs
from dsflash.model.config import ModelConfig
from dsflash.model.generate import generate
from dsflash.model.model import DSFlashModel
from dsflash.runtime.api import Runtime
from dsflash.runtime.generator import GenerationParams
from dsflash.runtime.weights import model_from_bundle

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "export.py"
SEED = 7


@pytest.fixture(scope="module")
def bf16_bundle(tmp_path_factory) -> Bundle:
    """The tiny model in bfloat16, portable graphs, two export workers (about a minute)."""
    out = tmp_path_factory.mktemp("bf16") / "tiny-bf16"
    subprocess.run([sys.executable, str(SCRIPT), "--config", "tiny", "--dtype", "bfloat16",
                    "--flavor", "portable", "--seed", str(SEED), "--workers", "2", "--out", str(out)],
                   check=True, capture_output=True, timeout=900)
    return Bundle.open(out)


@pytest.fixture(scope="module")
def bf16_model() -> DSFlashModel:
    return DSFlashModel(ModelConfig.preset("tiny")).init_weights(SEED).eval().to(torch.bfloat16)


def test_a_bf16_bundle_holds_bf16_graphs_and_loads_back_bit_for_bit(bf16_bundle, bf16_model):
    assert bf16_bundle.manifest["dtype"] == "bfloat16" and bf16_bundle.dtype == torch.bfloat16
    io = bf16_bundle.manifest["graphs"]["decoder_step"]["portable"]["io"]
    model_dtype = {t.name for t in graph_outputs(bf16_bundle.config, "decoder_step") if t.dtype == "model"}
    assert model_dtype and {t["dtype"] for t in io["outputs"] if t["name"] in model_dtype} == {"bfloat16"}
    model = model_from_bundle(bf16_bundle)
    want = dict(bf16_model.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16, name
        assert name.endswith("gate.bias_vl") or torch.equal(p, want[name]), name


def test_the_torch_backend_serves_a_bf16_bundle_as_the_bf16_model(bf16_bundle, bf16_model):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    rt = Runtime.from_bundle(bf16_bundle.path, backend="torch", slots=1, capacity=64)
    floats = {t.dtype for t in rt.generator.cache.cache.tensors.values() if t.is_floating_point()}
    assert torch.bfloat16 in floats  # the contract's model-dtype state
    out = rt.generate([prompt], GenerationParams(max_new_tokens=8))
    assert out[0].tokens == generate(bf16_model, [prompt], 8)[0]


def test_onnx_runtime_on_the_cpu_refuses_a_bf16_bundle_naming_why(bf16_bundle):
    with pytest.raises(BundleError, match="is bfloat16.*CPU provider.*ort-cuda, trt or torch"):
        Runtime.from_bundle(bf16_bundle.path, backend="ort", slots=1, capacity=64)


def test_a_bundle_declaring_another_dtype_is_refused_naming_it(tmp_path):
    bundle = Bundle(tmp_path, {"dtype": "float16"}, ModelConfig.preset("tiny"))
    with pytest.raises(BundleError, match="has dtype 'float16'; dsflash serves"):
        _ = bundle.dtype


class _Perturbed:
    """A graph engine whose `output` comes out scaled by (1 + eps), or, for an integer output,
    off by one: what a wrongly typed or wrongly wired graph would give."""

    def __init__(self, engine, output: str, eps: float = 0.0):
        self.engine, self.output, self.eps = engine, output, eps
        self.input_names, self.output_names = engine.input_names, engine.output_names

    def run(self, feeds):
        out = dict(self.engine.run(feeds))
        t = out[self.output]
        out[self.output] = t * (1 + self.eps) if t.is_floating_point() else t + 1
        return out


def test_the_low_precision_check_passes_the_reference_and_fails_a_wrong_graph(bf16_model):
    """export/accuracy_lowp.py on the CPU, the reference ops standing in for the graphs (the check
    runs ONNX Runtime's CUDA provider on a GPU: tests/test_ort_cuda.py): the bf16 reference
    itself passes with its own errors; logits 4% off fail the median rule; an integer output
    off by one is named."""
    from dsflash.export.accuracy_lowp import check_lowp_bundle
    from dsflash.runtime.engine import TorchEngine

    def engines():
        return {g: TorchEngine(bf16_model, g, ops="reference") for g in ("encoder_prefill", "decoder_step")}

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6], [2, 7, 1, 8, 2, 8]]
    report = check_lowp_bundle(engines(), bf16_model, prompts, decode_steps=6)
    assert report.passed and report.steps == 3 + 6, report.failures()
    logits = report.verdicts["decoder_step:logits"]
    assert logits.median == logits.reference_median > 0 and logits.flips == logits.reference_flips
    assert "encoder_prefill:new_kv.1" in report.verdicts and report.mismatch is None

    wrong = engines()
    wrong["decoder_step"] = _Perturbed(wrong["decoder_step"], "logits", eps=0.04)
    report = check_lowp_bundle(wrong, bf16_model, prompts, decode_steps=6)
    assert not report.passed
    assert [f.split(":")[:2] for f in report.failures()] == [["decoder_step", "logits"]]
    assert "median error" in report.failures()[0]

    wrong = engines()
    wrong["encoder_prefill"] = _Perturbed(wrong["encoder_prefill"], "new_seq_len")
    report = check_lowp_bundle(wrong, bf16_model, prompts, decode_steps=2)
    assert report.failures()[0] == "step 0 (encoder_prefill): new_seq_len differs from the reference"


def test_check_accuracy_on_a_bf16_bundle_says_it_runs_on_a_gpu(bf16_bundle):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run")
    script = SCRIPT.parent / "check_accuracy.py"
    for extra, why in (([], "checked on a CUDA GPU with onnxruntime-gpu"),
                       (["--flavor", "plugin"], "portable flavor on ONNX Runtime's CUDA provider")):
        run = subprocess.run([sys.executable, str(script), "--bundle", str(bf16_bundle.path), *extra],
                             capture_output=True, text=True, timeout=300, check=False)
        assert run.returncode == 2 and why in run.stderr, run.stderr


def test_the_low_precision_check_refuses_what_it_cannot_check(bf16_model):
    from dsflash.export.accuracy_lowp import check_lowp_bundle
    from dsflash.runtime.engine import TorchEngine

    engines = {g: TorchEngine(bf16_model, g, ops="reference") for g in ("encoder_prefill", "decoder_step")}
    fp32 = DSFlashModel(ModelConfig.preset("tiny")).eval()
    with pytest.raises(ValueError, match="float32 bundles take"):
        check_lowp_bundle(engines, fp32, [[1, 2]], 2)
    with pytest.raises(ValueError, match=r"lack the graphs \['encoder_prefill'\]"):
        check_lowp_bundle({"decoder_step": engines["decoder_step"]}, bf16_model, [[1, 2]], 2)
    with pytest.raises(ValueError, match=r"token id 512 outside the vocabulary \[0, 512\)"):
        check_lowp_bundle(engines, bf16_model, [[1, 512]], 2)
    with pytest.raises(ValueError, match="at least one decode step"):
        check_lowp_bundle(engines, bf16_model, [[1, 2]], 0)
