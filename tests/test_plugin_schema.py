"""One declaration per op feeds the torch op, its fake, the ONNX schema and the ORT op; check
that they all agree with it and with the reference (PIPELINE.md §4)."""

import onnx
import pytest
import torch

from dsflash.plugins.declaration import DOMAIN
from dsflash.plugins.onnx_translation import plugin_translation_table, register_onnx_schemas
from dsflash.plugins.registry import DECLS, MHC_BOUNDARY, MHC_PARTIALS, SPARSE_ATTENTION_SPLIT, OpSet
from dsflash.plugins.torch_ops import register_torch_ops

from tolerances import OP_FP32, assert_close


def sample_inputs(decl, gen):
    b, s, n, c, e = 2, 3, 7, 4, 8
    if decl.name == "EngramHashGather":
        return (torch.randint(-1, 50, (b, s + 3), generator=gen), torch.randn(600, 4, generator=gen)), \
            dict(multipliers=[3, 5, 7, 11], primes=[13, 17, 19, 23, 29, 31], offsets=[0, 13, 30, 49, 72, 101],
                 pad_id=2, heads=2)
    if decl.name == "Csa2IndexScore":
        return (torch.randn(b, s, 2, 4, generator=gen), torch.randn(b, s, 2, generator=gen),
                torch.randn(b, n, 4, generator=gen), torch.rand(b, s, n, generator=gen) > 0.3), {}
    if decl.name == "Csa2IndexScoreFp4":  # J = 64: two exponent blocks
        return (torch.randn(b, s, 2, 64, generator=gen), torch.randn(b, s, 2, generator=gen),
                torch.randint(0, 256, (b, n, 32), generator=gen, dtype=torch.uint8),
                torch.randint(-6, 4, (b, n, 2), generator=gen, dtype=torch.int8),
                torch.rand(b, s, n, generator=gen) > 0.3), {}
    if decl.name == "Csa2EntriesFp4":  # head_dim 32: 16 code bytes and 2 scales per entry; any bytes
        return (torch.randn(b, s, 2, 32, generator=gen), torch.randint(0, 256, (b, n, 16), generator=gen,
                                                                        dtype=torch.uint8),
                torch.randint(0, 127, (b, n, 2), generator=gen, dtype=torch.uint8),
                torch.randint(-1, n, (b, s, 3), generator=gen)), {}
    if decl.name.startswith("Csa2SparseAttention"):
        inputs = (torch.randn(b, s, 2, 8, generator=gen), torch.randn(b, n, 8, generator=gen),
                  torch.randint(-1, n, (b, s, 3), generator=gen), torch.randn(b, 5, 8, generator=gen),
                  torch.rand(b, s, 5, generator=gen) > 0.4, torch.randn(2, generator=gen))
        split = dict(block_keys=2, split_target=9) if decl.name.endswith("Split") else {}
        return inputs, dict(scale=0.3, **split)
    if decl.name == "Csa2AttentionCombine":
        inputs, _ = sample_inputs(SPARSE_ATTENTION_SPLIT, gen)
        acc, ml = SPARSE_ATTENTION_SPLIT.reference(*inputs, scale=0.3, block_keys=2, split_target=9)
        return (inputs[0], acc, ml, inputs[5]), {}
    m, e = (2 + c) * c, 40
    mhc = (torch.randn(b, s, c, e, generator=gen), torch.randn(b, s, e, generator=gen),
           torch.rand(b, s, c, generator=gen), torch.rand(b, s, c, c, generator=gen),
           torch.rand(b, s, c, generator=gen), torch.randn(m, c * e, generator=gen) * 0.1,
           torch.randn(m, generator=gen), torch.rand(3, generator=gen), torch.rand(e, generator=gen))
    site = {"iters": 20, "hc_eps": 1e-6, "rms_eps": 1e-20}
    # the split form: 3 chunks of 16 channels; one block of 6 rows aims at 2 splits (2 + 1 chunks)
    split = {"block_e": 16, "split_target": 2}
    if decl.name == "MhcBoundaryPartials":
        return mhc[:6], split
    if decl.name == "MhcBoundaryFinish":
        _, x_raw, mixes, sums = MHC_PARTIALS.reference(*mhc[:6], **split)
        return (x_raw, mixes, sums, *mhc[6:]), site
    return mhc, site


@pytest.mark.parametrize("decl", DECLS, ids=lambda d: d.name)
def test_torch_op_matches_reference_and_fake(decl, gen):
    register_torch_ops()
    op = getattr(torch.ops.dsflash, decl.torch_name)
    inputs, attrs = sample_inputs(decl, gen)
    decl.check_attrs(attrs)
    out = op(*inputs, *attrs.values())
    ref = decl.reference(*inputs, **attrs)
    outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
    assert len(outs) == len(decl.outputs)
    for o, r in zip(outs, refs):
        assert torch.equal(o, r)
    torch.library.opcheck(op, (*inputs, *attrs.values()),
                          test_utils=("test_schema", "test_faketensor"))
    assert str(op.default._schema).endswith(decl.schema().split("->")[1].strip())


@pytest.mark.parametrize("decl", DECLS, ids=lambda d: d.name)
def test_onnx_schema_matches_declaration(decl):
    register_onnx_schemas()
    schema = onnx.defs.get_schema(decl.name, 1, DOMAIN)
    assert [p.name for p in schema.inputs] == [p.name for p in decl.inputs]
    assert [p.name for p in schema.outputs] == [p.name for p in decl.outputs]
    assert set(schema.attributes) == {a.name for a in decl.attrs} | {"plugin_namespace", "plugin_version"}


def test_translation_table_covers_every_op():
    table = plugin_translation_table()
    assert {str(k) for k in table} == {f"dsflash.{d.torch_name}.default" for d in DECLS}


def test_opset_backends_agree(gen):
    ref, custom = OpSet("reference"), OpSet("custom_op")
    inputs, attrs = sample_inputs(DECLS[2], gen)
    assert torch.equal(ref.csa2_sparse_attention(*inputs, **attrs),
                       custom.csa2_sparse_attention(*inputs, **attrs))
    with pytest.raises(ValueError, match="unknown op backend 'cuda'"):
        OpSet("cuda")
    with pytest.raises(ValueError, match="unknown pool form 'sparse'"):
        OpSet("reference", pool_form="sparse")
    with pytest.raises(ValueError, match="unknown pool form 'masks'"):
        ref.pool_form = "masks"
    assert not ref.lists_pool and not custom.lists_pool
    ref.pool_form = "list"
    assert ref.lists_pool


def test_split_attention_form_matches_the_one_node_op(gen):
    """OpSet(split_attention=True), as decoder_step graphs export the attention: split + combine
    nodes (2 splits here) give the one-node op's result on both graph backends."""
    inputs, attrs = sample_inputs(DECLS[2], gen)
    want = OpSet("reference").csa2_sparse_attention(*inputs, **attrs)
    for backend in ("reference", "custom_op"):
        got = OpSet(backend, split_attention=True).csa2_sparse_attention(*inputs, **attrs)
        assert_close(got, want, OP_FP32, f"split form, {backend}")
    acc, _ = SPARSE_ATTENTION_SPLIT.reference(*inputs, scale=0.3, block_keys=2, split_target=9)
    # 2 + 3 blocks of 2 keys; 6 rows aim at cdiv(9, 6) = 2 splits of 3 blocks
    assert acc.shape[2] == 2


def test_split_mhc_form_matches_the_one_node_op(gen):
    """OpSet(split_mhc=True), as decoder_step graphs export the boundary: partials + finish nodes
    give the one-node op's result on both graph backends."""
    inputs, attrs = sample_inputs(MHC_BOUNDARY, gen)
    want = OpSet("reference").mhc_boundary(*inputs, **attrs)
    for backend in ("reference", "custom_op"):
        got = OpSet(backend, split_mhc=True).mhc_boundary(*inputs, **attrs)
        for name, g, w in zip(("new", "x", "pre", "post", "comb"), got, want, strict=True):
            assert_close(g, w, OP_FP32, f"split mHC form, {backend}: {name}")
    _, _, mixes, sums = MHC_PARTIALS.reference(*inputs[:6], block_e=16, split_target=300)
    assert mixes.shape == (3, 2, 3, 24) and sums.shape == (3, 2, 3, 2)  # a split per chunk
    _, split = sample_inputs(MHC_PARTIALS, gen)
    assert MHC_PARTIALS.reference(*inputs[:6], **split)[2].shape[0] == 2


@pytest.mark.parametrize("decl", DECLS, ids=lambda d: d.name)
def test_ort_op_runs_the_reference(decl, gen):
    """Build a one-node plugin graph as the exporter would, run it under ONNX Runtime."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from dsflash.plugins.ort_ops import ort_plugin_model, ort_session_options

    inputs, attrs = sample_inputs(decl, gen)
    types = {torch.float32: TensorProto.FLOAT, torch.int64: TensorProto.INT64, torch.bool: TensorProto.BOOL,
             torch.uint8: TensorProto.UINT8, torch.int8: TensorProto.INT8}
    ref = decl.reference(*inputs, **attrs)
    refs = ref if isinstance(ref, tuple) else (ref,)
    node = helper.make_node(decl.name, [p.name for p in decl.inputs], [p.name for p in decl.outputs],
                            domain=DOMAIN, plugin_namespace=DOMAIN, plugin_version="1", **attrs)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(p.name, types[t.dtype], list(t.shape))
                      for p, t in zip(decl.inputs, inputs)],
        [helper.make_tensor_value_info(p.name, types[r.dtype], None) for p, r in zip(decl.outputs, refs)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(DOMAIN, 1)])
    sess = ort.InferenceSession(ort_plugin_model(model).SerializeToString(), ort_session_options())
    outs = sess.run(None, {p.name: t.numpy() for p, t in zip(decl.inputs, inputs)})
    for o, r in zip(outs, refs):
        assert torch.equal(torch.from_numpy(o), r)
