"""TensorRT path: what needs no TensorRT is tested everywhere (the preflight of plugin graphs,
optimization profiles from the contract, plan/sidecar checks of TrtEngine); building and running
plans needs the full TensorRT builder and a GPU, which the project's machines lack (skipped with
that reason). The AOT kernels TensorRT would embed are tested in tests/test_aot.py."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

from dsflash.export.bundle import BundleError
from dsflash.export.trt_build import optimization_profiles, preflight, write_sidecar
from dsflash.runtime.trt_engine import TrtEngine, checked_plan

HAVE_BUILDER = importlib.util.find_spec("tensorrt") is not None


def _plugin_proto(bundle, graph="decoder_step"):
    return onnx.load(str(bundle.graph_path(graph, "plugin")), load_external_data=False)


def test_preflight_lists_the_plugins_of_each_graph(tiny_bundle):
    assert sorted(preflight(_plugin_proto(tiny_bundle))) == [  # decoder_step: the split forms
        "Csa2AttentionCombine", "Csa2IndexScore", "Csa2SparseAttentionSplit", "EngramHashGather",
        "MhcBoundaryFinish", "MhcBoundaryPartials"]
    assert sorted(preflight(_plugin_proto(tiny_bundle, "encoder_prefill"))) == [
        "Csa2IndexScore", "Csa2SparseAttention", "EngramHashGather", "MhcBoundary"]


def test_preflight_names_an_unknown_or_mismatched_plugin(tiny_bundle):
    proto = _plugin_proto(tiny_bundle)
    node = next(n for n in proto.graph.node if n.op_type == "Csa2IndexScore")
    node.op_type = "Csa2IndexScoreV9"
    with pytest.raises(BundleError, match="no plugin registered for trt.plugins::Csa2IndexScoreV9"):
        preflight(proto)
    proto = _plugin_proto(tiny_bundle)
    node = next(n for n in proto.graph.node if n.op_type == "MhcBoundaryFinish")
    next(a for a in node.attribute if a.name == "plugin_version").s = b"2"
    with pytest.raises(BundleError,
                       match=f"node {node.name} \\(MhcBoundaryFinish\\): plugin_namespace/plugin_version"):
        preflight(proto)


def test_preflight_refuses_fp64_tensors(tiny_bundle):
    # the parser would demote them to fp32 silently (as it did the rotary angles before session 29)
    proto = _plugin_proto(tiny_bundle)
    cast = onnx.helper.make_node("Cast", [proto.graph.input[0].name], ["ids_fp64"],
                                 to=onnx.TensorProto.DOUBLE)
    proto.graph.node.insert(0, cast)
    with pytest.raises(BundleError, match="1 fp64 tensors \\(first: 'ids_fp64'\\); TensorRT has no fp64"):
        preflight(proto)
    proto = _plugin_proto(tiny_bundle)
    proto.graph.initializer.append(onnx.numpy_helper.from_array(np.ones(3, np.float64), "freqs"))
    with pytest.raises(BundleError, match="first: 'freqs'"):
        preflight(proto)


def test_profiles_follow_the_contract(tiny_bundle):
    cfg = tiny_bundle.config
    prof = optimization_profiles(tiny_bundle, "decoder_step", max_batch=8, capacity=256, max_rows=16)
    assert prof["ids"] == ((1, 1), (8, 1), (8, 16))
    src = cfg.kv_source_layer_ids[0]
    n = 256 // cfg.layer_ratio(src)
    assert prof[f"kv.{src}"][2][:2] == (8, n)
    assert optimization_profiles(tiny_bundle, "encoder_prefill", 1, 64, 64)["ids"][1] == (1, 64)
    with pytest.raises(ValueError, match="capacity >= max_rows"):
        optimization_profiles(tiny_bundle, "decoder_step", 1, 8, 16)
    # the batch TensorRT picks tactics at: the one served most, within the profile
    low = optimization_profiles(tiny_bundle, "decoder_step", max_batch=8, capacity=256, max_rows=16,
                                opt_batch=2)
    assert low["ids"] == ((1, 1), (2, 1), (8, 16)) and low[f"kv.{src}"][1][:2] == (2, n)
    for bad in (0, 9):
        with pytest.raises(ValueError,
                           match=f"1 <= opt_batch <= max_batch; got opt_batch {bad}, max_batch 8"):
            optimization_profiles(tiny_bundle, "decoder_step", 8, 256, 16, opt_batch=bad)


def test_trt_engine_refuses_a_missing_or_stale_plan(tiny_bundle, tmp_path):
    with pytest.raises(BundleError, match="no TensorRT plan for decoder_step"):
        TrtEngine(tiny_bundle, "decoder_step")
    plans = tiny_bundle.path / "plans"
    plans.mkdir(exist_ok=True)
    plan = plans / "decoder_step.plan"
    try:
        plan.write_bytes(b"not a real plan")
        write_sidecar(tiny_bundle, "decoder_step", plan, {}, "test")
        assert checked_plan(tiny_bundle, "decoder_step") == plan
        plan.write_bytes(b"modified")
        with pytest.raises(BundleError, match="does not match its sha256"):
            checked_plan(tiny_bundle, "decoder_step")
        side = plans / "plans.json"
        data = json.loads(side.read_text())
        data["decoder_step"]["onnx_sha256"] = "0" * 64
        side.write_text(json.dumps(data))
        with pytest.raises(BundleError, match="rebuild the plan"):
            checked_plan(tiny_bundle, "decoder_step")
    finally:
        for f in plans.iterdir():
            f.unlink()
        plans.rmdir()


@pytest.mark.tensorrt
@pytest.mark.skipif(not HAVE_BUILDER, reason="the full TensorRT builder is not installable on this machine "
                    "(its package downloads from an unreachable vendor index), so no plan can be built")
def test_build_and_run_plans_match_the_reference(tiny_bundle, tiny_model):
    import torch

    from dsflash.export.trt_build import build_plan
    from dsflash.model.cache import ModelCache
    from dsflash.runtime.engine import TorchEngine

    from tolerances import MODEL, assert_close

    prof = optimization_profiles(tiny_bundle, "decoder_step", max_batch=2, capacity=64, max_rows=8)
    build_plan(tiny_bundle, "decoder_step", prof)
    cache = ModelCache.allocate(tiny_bundle.config, 1, 64)
    feeds = {"ids": torch.tensor([[5, 9, 100]]), **cache.gather(cache.slot_index([0]))}
    got = TrtEngine(tiny_bundle, "decoder_step").run(feeds)["logits"].cpu()
    assert_close(got, TorchEngine(tiny_model, "decoder_step").run(feeds)["logits"], MODEL, "trt logits")
