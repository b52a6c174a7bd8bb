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
