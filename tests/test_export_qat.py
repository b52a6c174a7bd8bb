"""Export of a kv_qat model (the released flash preset's FP8/FP4 round-trips) in both flavors:
the tiny sizes with index_head_dim 32 (one FP4 block), checked against PyTorch as test_export.py
checks the plain tiny model."""

import numpy as np
import pytest
import torch

from dsflash.export.accuracy import check_bundle, reference_steps
from dsflash.export.ort_greedy import OrtGraphs
from dsflash.export.rounding_flips import explain_flip
from dsflash.model.config import ModelConfig
from dsflash.model.generate import generate
from dsflash.model.model import DSFlashModel

from conftest import random_ids
from tolerances import MODEL


@pytest.fixture(scope="module")
def qat_model() -> DSFlashModel:
    cfg = ModelConfig.preset("tiny").replace(kv_qat=True, index_head_dim=32)
    return DSFlashModel(cfg).init_weights(seed=77).eval()


@pytest.fixture(scope="module")
def qat_bundle(qat_model, tmp_path_factory):
    """Both graphs in both flavors: 89 s on two workers with each kv_qat round-trip one traced node
    (2026-12-06; 125 s before, 332 s before exact_pow2's export form became one Gather)."""
    from dsflash.export.bundle import write_bundle

    return write_bundle(qat_model, tmp_path_factory.mktemp("bundle") / "tiny-qat", "tiny-qat",
                        ("plugin", "portable"), workers=2)


@pytest.mark.parametrize("flavor", ["portable", "plugin"])
def test_kv_qat_flavors_match_pytorch_with_polygraphy(qat_bundle, qat_model, gen, flavor):
    cfg = qat_model.cfg
    prompts = [random_ids(gen, 1, n, cfg.vocab_size)[0].tolist() for n in (19, 5)]
    steps = reference_steps(qat_model, prompts, decode_steps=8)
    report = check_bundle(qat_bundle, qat_model, flavor, steps)
    assert report.passed, report.first_failure
    assert report.steps == 11


def test_kv_qat_greedy_tokens_on_onnxruntime_equal_pytorch(qat_bundle, qat_model, gen):
    prompt = random_ids(gen, 1, 14, qat_model.cfg.vocab_size)[0].tolist()
    expected = generate(qat_model, [prompt], 24)[0]
    assert OrtGraphs(qat_bundle, "portable").greedy(prompt, 24) == expected


def test_kv_qat_graphs_carry_fp4_index_keys(qat_bundle):
    """The state holds the index keys and the compressed entries as the release does (codes +
    exponents, codes + e4m3 scales); the plugin graphs score the keys with Csa2IndexScoreFp4 nodes
    and decode the entries with a Csa2EntriesFp4 node per attending layer: the selected ones in
    decoder_step (S*K rows), every entry once in encoder_prefill."""
    import onnx

    cfg = qat_bundle.config
    for graph in ("encoder_prefill", "decoder_step"):
        proto = onnx.load(str(qat_bundle.graph_path(graph, "plugin")), load_external_data=False)
        types = {v.name: v.type.tensor_type.elem_type for v in (*proto.graph.input, *proto.graph.output)}
        src = cfg.kv_source_layer_ids[0]
        assert types[f"index_k.{src}"] == types[f"new_index_k.{src}"] == onnx.TensorProto.UINT8
        assert types[f"index_e.{src}"] == types[f"new_index_e.{src}"] == onnx.TensorProto.INT8
        assert types[f"kv.{src}"] == types[f"new_kv.{src}"] == onnx.TensorProto.UINT8
        assert types[f"kv_scale.{src}"] == types[f"new_kv_scale.{src}"] == onnx.TensorProto.UINT8
        ops = [n.op_type for n in proto.graph.node]
        assert "Csa2IndexScore" not in ops
        layers = range(cfg.num_hidden_layers if graph == "decoder_step" else cfg.first_decoder_layer)
        assert ops.count("Csa2EntriesFp4") == sum(cfg.layer_role(i) != "window" for i in layers) > 0
        if graph == "decoder_step":
            assert ops.count("Csa2IndexScoreFp4") == len(cfg.index_source_layer_ids)


def test_kv_qat_needs_whole_quantisation_blocks():
    with pytest.raises(ValueError, match="index_head_dim=16 must be a multiple of 32 with kv_qat"):
        ModelConfig.preset("tiny").replace(kv_qat=True)
    with pytest.raises(ValueError, match="head_dim=48 must be a multiple of 32 with kv_qat"):
        ModelConfig.preset("tiny").replace(kv_qat=True, index_head_dim=32, head_dim=48)



def _step(layers=3, dim=32, seed=0):
    """Outputs of a decode step with quantised-looking rows: e4m3 window rows, FP4 entries."""
    rng = np.random.default_rng(seed)
    rows = torch.from_numpy(rng.standard_normal((layers, 1, 1, dim)).astype(np.float32))
    rows = rows.to(torch.float8_e4m3fn).float().numpy()
    return {"new_swa_rows": rows, "new_kv.1": np.array([[[0.5, 1.0, -3.0, 6.0]]], np.float32),
            "logits": rng.standard_normal((1, 50)).astype(np.float32)}


def _neighbour_up(v: float) -> float:
    """The next e4m3 value above v (> 0)."""
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return float(e4m3[e4m3 > v][0])


def test_a_one_step_flip_is_explained_and_what_follows_it_is_not_compared():
    want = _step()
    got = {k: v.copy() for k, v in want.items()}
    v = abs(float(want["new_swa_rows"][1, 0, 0, 3]))
    got["new_swa_rows"][1, 0, 0, 3] = np.sign(want["new_swa_rows"][1, 0, 0, 3]) * _neighbour_up(v)
    got["new_swa_rows"][2] += 0.3  # layers after the flip see other inputs
    got["logits"] += 1e-3          # small enough to keep the greedy token
    assert explain_flip(got, want, MODEL) == "rounding flip at layer 1: 1 element(s) one grid step apart"


def test_a_flipped_entry_scale_is_explained_as_a_flip():
    """An entry block's e4m3 scale (amax / 6) can itself sit at a rounding boundary: ONNX Runtime
    and PyTorch then store adjacent scales, and the block's 16 codes re-round against them. The
    packed entries are compared as the values they stand for, and each of those stays within one
    e2m1 step of the other side, so the step counts as a flip at that layer, not a failure."""
    from dsflash.model.quant import fp4_e4m3scale_pack

    s1, s2 = 0.5, 0.5625  # adjacent e4m3 values: amax = 6 x their midpoint is the boundary
    x = torch.linspace(-1.0, 1.0, 32) * 6 * (s1 + s2) / 2
    outputs = []
    for nudge in (1 - 2.0**-20, 1 + 2.0**-20):  # the two sides of the boundary, as two runtimes
        codes, scales = fp4_e4m3scale_pack((x * nudge).view(1, 1, 32))
        outputs.append({"new_kv.1": codes.numpy(), "new_kv_scale.1": scales.numpy(),
                        "logits": np.arange(5, dtype=np.float32)[None]})
    want, got = outputs
    flipped = got["new_kv_scale.1"] != want["new_kv_scale.1"]
    assert flipped.sum() == 2  # both blocks hold the amax: both scales flip
    why = explain_flip(got, want, MODEL)
    assert why is not None and why.startswith("rounding flip at layer 1:")


@pytest.mark.parametrize("change", ["two_steps", "sign", "greedy_token", "logits_only",
                                    "entry_not_neighbour"])
def test_what_is_not_a_flip(change):
    want = _step()
    got = {k: v.copy() for k, v in want.items()}
    v = float(want["new_swa_rows"][0, 0, 0, 5])
    if change == "two_steps":
        got["new_swa_rows"][0, 0, 0, 5] = np.sign(v) * _neighbour_up(_neighbour_up(abs(v)))
    elif change == "sign":
        got["new_swa_rows"][0, 0, 0, 5] = -v
    elif change == "greedy_token":
        got["new_swa_rows"][0, 0, 0, 5] = np.sign(v) * _neighbour_up(abs(v))
        got["logits"][0, want["logits"][0].argmin()] = 100.0
    elif change == "logits_only":
        got["logits"] += 1e-3
    else:  # 6.0 -> -3.0 is no single e2m1 step
        got["new_kv.1"][0, 0, 3] = -3.0
    assert explain_flip(got, want, MODEL) is None


def test_flips_at_many_steps_fail_the_check(qat_bundle, qat_model, gen):
    """A check whose steps all differ by flips fails: flips must stay rare."""
    cfg = qat_model.cfg
    prompts = [random_ids(gen, 1, 9, cfg.vocab_size)[0].tolist()]
    steps = reference_steps(qat_model, prompts, decode_steps=4)
    for st in steps:  # every reference step moves one window value by one e4m3 step
        rows = st.outputs["new_swa_rows"]
        v = float(rows[0, 0, 0, 0])
        rows[0, 0, 0, 0] = np.sign(v or 1.0) * _neighbour_up(abs(v))
    report = check_bundle(qat_bundle, qat_model, "portable", steps)
    n = len(steps)
    assert len(report.flips) == n > 4
    assert not report.passed and report.first_failure.startswith(f"rounding flips at {n} of {n} steps")


@pytest.mark.parametrize("backend", ["ort", "ort-plugin"])
def test_kv_qat_runtime_serves_the_fp4_key_state(qat_bundle, qat_model, gen, backend):
    """The runtime over a kv_qat bundle: the cache manager keeps the uint8/int8 key state that
    the graphs read and return, with continuous batching; tokens equal PyTorch's, one request at a
    time."""
    from dsflash.runtime.cache_manager import CacheManager
    from dsflash.runtime.engine import make_engines
    from dsflash.runtime.generator import Generator
    from dsflash.runtime.request import GenerationParams

    cfg = qat_model.cfg
    prompts = [random_ids(gen, 1, n, cfg.vocab_size)[0].tolist() for n in (17, 6)]
    expected = [generate(qat_model, [p], 12)[0] for p in prompts]
    manager = CacheManager(cfg, 2, 64)
    assert manager.cache.tensors["index_k.1"].dtype == torch.uint8
    g = Generator(make_engines(backend, bundle=qat_bundle, model=qat_model), manager)
    ids = [g.add(p, GenerationParams(max_new_tokens=12)) for p in prompts]
    done = g.run()
    assert [done[i].tokens for i in ids] == expected


def test_packed_index_keys_are_compared_as_their_fp4_values():
    """kv_qat steps return index keys packed: a flip there is judged on the values the codes and
    exponents stand for (0.5 -> 1.0 is one e2m1 step; a sign is not)."""
    from dsflash.model.quant import fp4_pow2_pack

    codes, exps = fp4_pow2_pack(torch.tensor([[[0.5, 1.0] + [0.0] * 30]]) * 3.0)
    want = {"new_index_k.4": codes.numpy(), "new_index_e.4": exps.numpy(),
            "logits": np.array([[0.0, 1.0]], np.float32)}
    got = {k: v.copy() for k, v in want.items()}
    low = int(got["new_index_k.4"][0, 0, 0]) & 15
    got["new_index_k.4"][0, 0, 0] = (int(got["new_index_k.4"][0, 0, 0]) & 0xF0) | (low + 1)  # next code up
    assert explain_flip(got, want, MODEL) == "rounding flip at layer 4: 1 element(s) one grid step apart"
    got["new_index_k.4"][0, 0, 0] = (int(want["new_index_k.4"][0, 0, 0]) & 0xF0) | (low | 8)  # sign
    assert explain_flip(got, want, MODEL) is None
