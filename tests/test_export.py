"""Export of both graphs in both flavors, the bundle manifest and loader, Polygraphy checks."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch

from dsflash.export.accuracy import check_bundle, reference_steps
from dsflash.export.bundle import Bundle, BundleError
from dsflash.export.contract import GRAPHS, graph_inputs, graph_outputs
from dsflash.export.ort_greedy import OrtGraphs
from dsflash.export.trt_build import fp64_sources
from dsflash.model.generate import generate
from dsflash.plugins.declaration import DOMAIN
from dsflash.plugins.registry import DECLS

from conftest import random_ids

STANDARD_DOMAINS = {"", "ai.onnx"}


def load(bundle, graph, flavor, data=False):
    return onnx.load(str(bundle.graph_path(graph, flavor)), load_external_data=data)


def test_checker_passes_and_io_follows_the_contract(tiny_bundle):
    from dsflash.plugins.onnx_translation import register_onnx_schemas

    register_onnx_schemas()
    for graph in GRAPHS:
        for flavor in ("plugin", "portable"):
            onnx.checker.check_model(str(tiny_bundle.graph_path(graph, flavor)), full_check=True)
            proto = load(tiny_bundle, graph, flavor)
            cfg = tiny_bundle.config
            assert [i.name for i in proto.graph.input] == [t.name for t in graph_inputs(cfg, graph)]
            assert [o.name for o in proto.graph.output] == [t.name for t in graph_outputs(cfg, graph)]


def test_portable_has_only_standard_ops(tiny_bundle):
    for graph in GRAPHS:
        proto = load(tiny_bundle, graph, "portable")
        assert {n.domain for n in proto.graph.node} <= STANDARD_DOMAINS
        assert {i.domain for i in proto.opset_import} <= STANDARD_DOMAINS


def test_graphs_hold_no_fp64_tensor(tiny_bundle):
    # TensorRT has no fp64 type: its ONNX parser turns fp64 casts and weights into fp32 ones, which
    # would form the rotary angles as fp32 products (0.06 rad off at 1M positions; test_rope.py)
    for graph in GRAPHS:
        for flavor in ("plugin", "portable"):
            proto = load(tiny_bundle, graph, flavor)
            assert fp64_sources(proto) == [], (graph, flavor)
            inferred = onnx.shape_inference.infer_shapes(proto)  # and no value computed in fp64
            types = {v.type.tensor_type.elem_type for v in inferred.graph.value_info}
            assert onnx.TensorProto.DOUBLE not in types, (graph, flavor)


def test_plugin_nodes_carry_what_the_tensorrt_parser_needs(tiny_bundle):
    cfg = tiny_bundle.config
    expected_counts = {
        # decoder_step: Engram layers; Full + Reindex layers score; one
        # boundary after each attention and between layers except where Engram breaks it.
        "decoder_step": {"EngramHashGather": len(cfg.engram_layer_ids),
                         "Csa2IndexScore": len(cfg.index_source_layer_ids),
                         # every layer attends, in the split form (two nodes)
                         "Csa2SparseAttentionSplit": cfg.num_hidden_layers,
                         "Csa2AttentionCombine": cfg.num_hidden_layers,
                         # and every boundary in the mHC split form (two nodes)
                         **dict.fromkeys(("MhcBoundaryPartials", "MhcBoundaryFinish"),
                                         2 * cfg.num_hidden_layers - 1 - len([i for i in cfg.engram_layer_ids
                                                                              if i > 0]))},
        "encoder_prefill": {"EngramHashGather": len(cfg.engram_layer_ids),
                            "Csa2IndexScore": len([i for i in cfg.index_source_layer_ids
                                                   if i < cfg.first_decoder_layer]),
                            "Csa2SparseAttention": cfg.first_decoder_layer,
                            "MhcBoundary": 2 * cfg.first_decoder_layer - 1 - len(
                                [i for i in cfg.engram_layer_ids if 0 < i < cfg.first_decoder_layer])},
    }
    attrs_of = {d.name: {a.name for a in d.attrs} | {"plugin_namespace", "plugin_version"} for d in DECLS}
    for graph, counts in expected_counts.items():
        proto = load(tiny_bundle, graph, "plugin")
        custom = [n for n in proto.graph.node if n.domain not in STANDARD_DOMAINS]
        got = {}
        for node in custom:
            assert node.domain == DOMAIN
            got[node.op_type] = got.get(node.op_type, 0) + 1
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert set(attrs) == attrs_of[node.op_type]
            assert attrs["plugin_namespace"] == DOMAIN.encode() and attrs["plugin_version"] == b"1"
        assert got == counts, graph
        assert {"": 18, DOMAIN: 1}.keys() <= {i.domain for i in proto.opset_import} | {""}
        assert sorted(counts) == tiny_bundle.manifest["graphs"][graph]["plugin"]["custom_ops"]


@pytest.mark.slow
def test_bf16_plugin_graphs_feed_each_plugin_its_declared_types(tiny_cfg):
    """A bf16 model's plugin graphs pass the ONNX checker's full check, and every custom node's
    inputs and outputs have the types its declaration gives (model-dtype ports bf16, fp32 ports
    float), which are the types its TensorRT registration accepts (plugins/trt_types.io_types
    builds them from the same ports)."""
    from dsflash.export.onnx_export import export_graph
    from dsflash.model.model import DSFlashModel
    from dsflash.plugins.onnx_translation import register_onnx_schemas
    from dsflash.plugins.trt_types import io_types

    register_onnx_schemas()
    model = DSFlashModel(tiny_cfg).init_weights(seed=3).eval().to(torch.bfloat16)
    decls = {d.name: d for d in DECLS}
    t = onnx.TensorProto
    names = {t.BFLOAT16: "BF16", t.FLOAT: "FP32", t.INT64: "INT64", t.BOOL: "BOOL"}
    for graph in GRAPHS:
        exported = export_graph(model, graph, "plugin")
        # the full check runs ONNX's type and shape inference on every node: a bf16 graph fails it
        # where an op's schema has no bfloat16 (Einsum had none; the model uses MatMul)
        onnx.checker.check_model(exported, full_check=True)
        proto = onnx.shape_inference.infer_shapes(exported)
        types = {v.name: v.type.tensor_type.elem_type
                 for v in (*proto.graph.value_info, *proto.graph.input, *proto.graph.output)}
        types |= {t.name: t.data_type for t in proto.graph.initializer}
        seen = set()
        for node in proto.graph.node:
            if node.domain != DOMAIN:
                continue
            got = ", ".join(names[types[name]] for name in (*node.input, *node.output))
            assert got == io_types(decls[node.op_type], "BF16"), (graph, node.op_type, got)
            seen.add(node.op_type)
        split = graph == "decoder_step"
        boundary = {"MhcBoundaryPartials", "MhcBoundaryFinish"} if split else {"MhcBoundary"}
        assert boundary | {"Csa2IndexScore", "EngramHashGather"} <= seen, (graph, seen)


@pytest.mark.parametrize("flavor", ["portable", "plugin"])
def test_flavors_match_pytorch_with_polygraphy(tiny_bundle, tiny_model, gen, flavor, tmp_path):
    cfg = tiny_model.cfg
    # one prompt longer than the window (replay through encoder_prefill), one shorter
    prompts = [random_ids(gen, 1, n, cfg.vocab_size)[0].tolist() for n in (19, 5)]
    steps = reference_steps(tiny_model, prompts, decode_steps=8)
    assert [s.graph for s in steps].count("encoder_prefill") == 1
    report = check_bundle(tiny_bundle, tiny_model, flavor, steps, save_dir=tmp_path)
    assert report.passed, report.first_failure
    assert report.steps == 11
    assert (tmp_path / "decoder_step.inputs.json").is_file()


def test_check_reports_first_diverging_step(tiny_bundle, tiny_model, gen):
    prompts = [random_ids(gen, 1, 6, tiny_model.cfg.vocab_size)[0].tolist()]
    steps = reference_steps(tiny_model, prompts, decode_steps=3)
    steps[2].outputs["logits"] = steps[2].outputs["logits"] + 1e-3  # corrupt decode step 2's reference
    report = check_bundle(tiny_bundle, tiny_model, "portable", steps)
    assert not report.passed
    assert report.first_failure.startswith("step 2 ") and report.first_failure.endswith("output logits")


def test_greedy_tokens_on_onnxruntime_equal_pytorch(tiny_bundle, tiny_model, gen):
    prompt = random_ids(gen, 1, 14, tiny_model.cfg.vocab_size)[0].tolist()
    expected = generate(tiny_model, [prompt], 32)[0]
    assert OrtGraphs(tiny_bundle, "portable").greedy(prompt, 32) == expected


def test_manifest_round_trip(tiny_bundle):
    again = Bundle.open(tiny_bundle.path)
    assert again.manifest == json.loads((tiny_bundle.path / "manifest.json").read_text())
    assert again.config == tiny_bundle.config
    m = again.manifest
    assert set(m["files"]) == {"config.json", "weights.bin"} | {f"{g}.{f}.onnx" for g in GRAPHS
                                                                 for f in ("plugin", "portable")}
    assert {"torch", "onnx", "onnxruntime", "dsflash"} <= set(m["versions"])
    assert m["contract"]["graphs"]["decoder_step"]["inputs"][0]["name"] == "ids"
    io = m["graphs"]["decoder_step"]["portable"]["io"]
    assert io["inputs"][0]["shape"][0] == io["inputs"][1]["shape"][1]  # the same batch dim name


def test_shared_weights_stored_once(tiny_bundle, tiny_model):
    n_params = sum(p.numel() for p in tiny_model.parameters())
    size = (tiny_bundle.path / "weights.bin").stat().st_size
    assert size < 1.1 * 4 * n_params  # every parameter once (plus alignment), not once per graph
    total_onnx = sum((tiny_bundle.path / f).stat().st_size for f in tiny_bundle.manifest["files"]
                     if f.endswith(".onnx"))
    assert total_onnx < size * 6  # graphs hold structure, not weights


def test_graphs_take_the_routed_experts_as_three_stacks_per_moe(tiny_bundle, tiny_model):
    """One initializer per stack, not per expert: torch.export lifts every parameter and its
    decomposition is quadratic in their count (the flash preset's 46,080 expert weights kept
    its decode-step export from finishing within an hour)."""
    cfg = tiny_model.cfg
    for graph in GRAPHS:
        names = {i.name for i in load(tiny_bundle, graph, "portable").graph.initializer}
        assert not [n for n in names if ".ffn.experts." in n], graph
        layers = range(cfg.first_decoder_layer) if graph == "encoder_prefill" else range(
            cfg.num_hidden_layers)
        for layer in layers:
            assert {f"layers.{layer}.ffn.routed_{w}" for w in ("w1", "w3", "w2")} <= names, (graph, layer)


@pytest.fixture
def bundle_copy(tiny_bundle, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(tiny_bundle.path, dst)
    return dst


def test_modified_files_are_refused(bundle_copy):
    with open(bundle_copy / "weights.bin", "r+b") as f:
        f.seek(100)
        f.write(b"\x01\x02")
    with pytest.raises(BundleError, match="bundle file weights.bin does not match its sha256"):
        Bundle.open(bundle_copy)


def test_modified_graph_is_refused(bundle_copy):
    path = bundle_copy / "decoder_step.portable.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    proto.producer_name = "someone else"
    onnx.save(proto, str(path))
    with pytest.raises(BundleError, match="decoder_step.portable.onnx does not match its sha256"):
        Bundle.open(bundle_copy)


def test_graph_io_differing_from_contract_is_refused(bundle_copy):
    from dsflash.export.bundle import onnx_io, sha256_file

    path = bundle_copy / "encoder_prefill.portable.onnx"
    proto = onnx.load(str(path), load_external_data=False)
    proto.graph.output[1].name = "new_kv.renamed"
    for node in proto.graph.node:
        node.output[:] = ["new_kv.renamed" if o == "new_kv.1" else o for o in node.output]
    onnx.save(proto, str(path))
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    manifest["files"][path.name] = sha256_file(path)
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"encoder_prefill \(portable\) does not match the manifest: "
                                          r"output 1: name 'new_kv.renamed' != expected 'new_kv.1'"):
        Bundle.open(bundle_copy)
    manifest["graphs"]["encoder_prefill"]["portable"]["io"] = onnx_io(proto)  # manifest agrees now
    (bundle_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="does not match the contract: output 1: name 'new_kv.renamed'"):
        Bundle.open(bundle_copy)


def test_missing_flavor_named(tiny_bundle):
    with pytest.raises(BundleError, match="has no 'tensorrt' 'decoder_step' graph"):
        tiny_bundle.graph_path("decoder_step", "tensorrt")


def test_ids_out_of_range_refused_before_the_graph(tiny_bundle):
    from dsflash.model.cache import ModelCache

    graphs = OrtGraphs(tiny_bundle, "portable")
    cache = ModelCache.allocate(tiny_bundle.config, 1, 8)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 512\)"):
        graphs.run("decoder_step", torch.tensor([[600]]), cache, [0])


def test_a_check_on_the_cuda_provider_refuses_to_run_on_the_cpu(tiny_bundle, tiny_model, gen):
    """check_bundle(providers=cuda_providers()) checks the graphs as ort-cuda runs them; where
    ONNX Runtime falls back to the CPU (no onnxruntime-gpu or no GPU) it fails, naming why,
    rather than report a CPU check as a CUDA one. The script refuses before any work."""
    import onnxruntime as ort

    from dsflash.export.ort_session import cuda_providers

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("the CUDA provider is available here (tests/test_ort_cuda.py checks it)")
    steps = reference_steps(tiny_model, [random_ids(gen, 1, 5, tiny_model.cfg.vocab_size)[0].tolist()], 1)
    with pytest.raises(RuntimeError, match="did not enable the CUDA provider"):
        check_bundle(tiny_bundle, tiny_model, "portable", steps, providers=cuda_providers())
    script = Path(__file__).resolve().parents[1] / "scripts" / "check_accuracy.py"
    run = subprocess.run([sys.executable, str(script), "--bundle", str(tiny_bundle.path),
                          "--provider", "cuda"], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 2 and "--provider cuda needs onnxruntime-gpu" in run.stderr, run.stderr
