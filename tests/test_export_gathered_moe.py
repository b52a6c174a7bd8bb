"""decoder_step exported with its routed experts gathered (write_bundle's decode_moe "gathered",
scripts/export.py --decode-moe gathered): the graph reads each row's k experts out of the
stacks, encoder_prefill stays dense, and the bundle matches PyTorch on ONNX Runtime."""

import json
import shutil

import onnx
import pytest

from dsflash.export.bundle import Bundle, BundleError, write_bundle
from dsflash.export.trt_build import decode_moe_advice
from dsflash.model.moe import MoE

from conftest import assert_export_option_refused, check_two_sequences, run_script


@pytest.fixture(scope="module")
def gathered_bundle(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("gathered") / "tiny-gathered"
    return write_bundle(tiny_model, path, "tiny-gathered", ("portable",), workers=2, decode_moe="gathered")


def _stack_readers(bundle, graph):
    """{op type: count} of the nodes that read a routed stack (`...ffn.routed_w1`), through the
    Transposes the exporter puts on them (an identity here, a [E, H, I] view in the dense form)."""
    proto = onnx.load(str(bundle.graph_path(graph, "portable")), load_external_data=False)
    readers: dict = {}
    names = {i.name for i in proto.graph.initializer if i.name.rsplit(".", 1)[-1].startswith("routed_w")}
    while names:
        found = set()
        for node in proto.graph.node:
            if names & set(node.input):
                if node.op_type == "Transpose":
                    found |= set(node.output)
                else:
                    readers[node.op_type] = readers.get(node.op_type, 0) + 1
        names = found
    return readers


def test_decoder_step_gathers_the_routed_experts(gathered_bundle, tiny_bundle, tiny_model):
    assert gathered_bundle.decode_moe == "gathered" and tiny_bundle.decode_moe == "dense"
    options = {"decode_attention": "split", "decode_moe": "gathered"}
    assert gathered_bundle.manifest["export_options"] == options
    moe_layers = sum(isinstance(m, MoE) and not m.dense for m in tiny_model.modules())
    assert moe_layers > 0
    # three stacks per MoE, each read by one gather of its rows' k experts
    assert _stack_readers(gathered_bundle, "decoder_step") == {"GatherND": 3 * moe_layers}
    # the dense form multiplies the stacks whole; encoder_prefill keeps it in both bundles
    for bundle, graph in ((tiny_bundle, "decoder_step"), (gathered_bundle, "encoder_prefill")):
        readers = _stack_readers(bundle, graph)
        assert readers and not {"Gather", "GatherND"} & set(readers), (bundle.path, graph, readers)


def test_gathered_experts_match_pytorch(gathered_bundle, tiny_model, gen):
    # two sequences decoded together: decoder_step gathers for more than one row
    report = check_two_sequences(gathered_bundle, tiny_model, "portable", gen)
    assert report.passed, report.first_failure
    assert report.steps == 11


def test_an_unknown_form_is_refused(tiny_model, gathered_bundle, tmp_path):
    forms = "forms: \\('dense', 'gathered'\\)"
    message = f"unknown decode MoE form 'sparse'; {forms}"
    assert_export_option_refused(tiny_model, tmp_path, "portable", message, decode_moe="sparse")
    copy = tmp_path / "copy"
    shutil.copytree(gathered_bundle.path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["export_options"]["decode_moe"] = "sparse"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=f"has decode_moe 'sparse'; {forms}"):
        Bundle.open(copy).decode_moe
    bad = run_script("export.py", "--out", "unused", "--decode-moe", "sparse", check=False)
    assert bad.returncode == 2 and "invalid choice: 'sparse' (choose from" in bad.stderr, bad.stderr


def test_the_build_advises_by_counted_bytes(tiny_bundle, gathered_bundle, tiny_cfg):
    # tiny: 8 experts, k = 2: gathered (3 passes over rows x k) moves fewer below 8 / (3 * 2) rows
    assert tiny_cfg.n_routed_experts == 8 and tiny_cfg.num_experts_per_tok == 2
    (dense_one,) = decode_moe_advice(tiny_bundle, 1, 4)
    assert "--decode-moe gathered would move 0.75x the expert bytes (fewer below 1.3 rows)" in dense_one
    assert decode_moe_advice(tiny_bundle, 2, 4) == []
    assert decode_moe_advice(gathered_bundle, 1, 4) == [
        "decoder_step's gathered experts take 0.00 GiB per MoE layer at the profile's 4 rows"]
    heavy, memory = decode_moe_advice(gathered_bundle, 8, 64)
    assert "moves 6.00x the bytes of the dense form (--decode-moe dense is lighter from 1.3 rows)" in heavy
    assert "at the profile's 64 rows" in memory
    with pytest.raises(ValueError, match="need 1 <= opt_rows <= max_rows; got opt_rows 5, max_rows 4"):
        decode_moe_advice(tiny_bundle, 5, 4)
