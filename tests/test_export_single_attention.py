"""decoder_step exported with its attention as one plugin node (write_bundle's decode_attention
"single", scripts/export.py --decode-attention single): the graph, the manifest, and its results
against PyTorch on ONNX Runtime's plugin ops."""

import json
import shutil

import onnx
import pytest

from dsflash.export.bundle import Bundle, BundleError, write_bundle
from dsflash.export.trt_build import preflight

from conftest import assert_export_option_refused, check_two_sequences

SPLIT_PAIR = {"Csa2SparseAttentionSplit", "Csa2AttentionCombine"}


@pytest.fixture(scope="module")
def single_bundle(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("single") / "tiny-single"
    return write_bundle(tiny_model, path, "tiny-single", ("plugin",), workers=2, decode_attention="single")


def _op_counts(bundle, graph):
    proto = onnx.load(str(bundle.graph_path(graph, "plugin")), load_external_data=False)
    counts = {}
    for node in proto.graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def test_decoder_step_has_one_attention_node_per_layer(single_bundle, tiny_cfg):
    assert single_bundle.decode_attention == "single"
    assert single_bundle.manifest["export_options"] == {"decode_attention": "single", "decode_moe": "dense"}
    counts = _op_counts(single_bundle, "decoder_step")
    assert counts["Csa2SparseAttention"] == tiny_cfg.num_hidden_layers
    assert not SPLIT_PAIR & set(counts)
    # the mHC boundaries keep their split form: it still wins at a decode batch (bench_aot.py)
    assert counts["MhcBoundaryPartials"] == counts["MhcBoundaryFinish"] > 0
    custom = single_bundle.manifest["graphs"]["decoder_step"]["plugin"]["custom_ops"]
    assert "Csa2SparseAttention" in custom and not SPLIT_PAIR & set(custom)
    proto = onnx.load(str(single_bundle.graph_path("decoder_step", "plugin")), load_external_data=False)
    assert "Csa2SparseAttention" in preflight(proto)
    # encoder_prefill is the same in both forms
    assert _op_counts(single_bundle, "encoder_prefill")["Csa2SparseAttention"] == tiny_cfg.first_decoder_layer


def test_the_default_bundle_is_split(tiny_bundle):
    assert tiny_bundle.decode_attention == "split"
    assert SPLIT_PAIR <= set(tiny_bundle.manifest["graphs"]["decoder_step"]["plugin"]["custom_ops"])


def test_single_attention_matches_pytorch(single_bundle, tiny_model, gen):
    # decode rows of two sequences through the one-node attention
    report = check_two_sequences(single_bundle, tiny_model, "plugin", gen)
    assert report.passed, report.first_failure
    assert report.steps == 11


def test_an_unknown_form_is_refused_before_exporting(tiny_model, tmp_path):
    forms = "forms: \\('split', 'single'\\)"
    message = f"unknown decode attention form 'fused'; {forms}"
    assert_export_option_refused(tiny_model, tmp_path, "plugin", message, decode_attention="fused")


def test_a_manifest_with_an_unknown_form_is_refused(single_bundle, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(single_bundle.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["export_options"]["decode_attention"] = "fused"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    bundle = Bundle.open(copy)
    with pytest.raises(BundleError, match="has decode_attention 'fused'; forms: \\('split', 'single'\\)"):
        bundle.decode_attention


def test_the_export_script_offers_the_forms():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "export.py"
    run = subprocess.run([sys.executable, str(script), "--out", "unused", "--decode-attention", "fused"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "invalid choice: 'fused' (choose from" in run.stderr, run.stderr


def test_the_build_advises_the_faster_form_for_its_batch(tiny_bundle, single_bundle):
    from dsflash.export.trt_build import decode_attention_advice

    assert decode_attention_advice(tiny_bundle, 32) is None
    assert decode_attention_advice(tiny_bundle, 1) is None
    advice = decode_attention_advice(tiny_bundle, 64)
    assert "'split' form, tuned here for 64 rows" in advice and "--decode-attention single" in advice
    assert decode_attention_advice(single_bundle, 48) is None
    assert decode_attention_advice(single_bundle, 128) is None
    assert "--decode-attention split" in decode_attention_advice(single_bundle, 8)
    assert decode_attention_advice(single_bundle, 40) is None  # between the measured rows: no advice
    with pytest.raises(ValueError, match="opt_rows must be >= 1, got 0"):
        decode_attention_advice(tiny_bundle, 0)
