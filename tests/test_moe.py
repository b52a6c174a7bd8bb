"""The graph forms of two grouped products against the forms they replace.

The MoE's dense dispatch (what export and CUDA-graph capture run: every expert on every row,
weight 0 where not routed) and its gathered form (a captured or compiled step of one sequence,
decoder_step exported with decode_moe "gathered": only the routed experts) against its
per-expert loop, and the grouped o-projection against
each group's own map. Both are MatMuls, not einsum, because ONNX's Einsum has no bfloat16 type
(test_export checks bf16 graphs with the ONNX checker)."""

from __future__ import annotations

import copy

import pytest
import torch

from tolerances import OP_FP32, assert_close, kernel_bound


def dense_moe(moe, x_TE):
    idx, w = moe.gate(x_TE)
    return moe._add_shared(x_TE, moe._dense_dispatch(x_TE, idx, w))


def loop_moe(moe, x_TE):
    return moe(x_TE.unsqueeze(0)).squeeze(0).float()


def test_dense_dispatch_equals_the_expert_loop_fp32(tiny_model, gen):
    moe = tiny_model.layers[0].ffn
    assert not moe.dense and len(moe.experts) > moe.gate.top_k
    x = torch.randn(37, tiny_model.cfg.hidden_size, generator=gen)
    with torch.no_grad():
        assert_close(dense_moe(moe, x), loop_moe(moe, x), OP_FP32, "dense dispatch, fp32")


def test_dense_dispatch_bf16_within_the_rounding_rule(tiny_model, gen):
    """bf16: both forms against the fp32 loop; the dense form (one rounding of the sum over
    experts) may be off by at most the §7 bound of the loop's own bf16 error."""
    moe = tiny_model.layers[0].ffn
    x = torch.randn(37, tiny_model.cfg.hidden_size, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        exact = loop_moe(moe, x.float())
        low = copy.deepcopy(moe).to(torch.bfloat16)  # a copy: the model is shared by other tests
        err_loop = (loop_moe(low, x) - exact).abs().max().item()
        err_dense = (dense_moe(low, x) - exact).abs().max().item()
    assert err_dense <= kernel_bound(err_loop, torch.bfloat16), (err_dense, err_loop)


def gathered_moe(moe, x_TE):
    idx, w = moe.gate(x_TE)
    return moe._add_shared(x_TE, moe._gathered_dispatch(x_TE, idx, w))


@pytest.mark.parametrize("rows", [1, 3, 37])
def test_gathered_dispatch_equals_the_expert_loop(tiny_model, gen, rows):
    """The graph form that reads only each row's k routed experts (a captured one-sequence decode
    step; decoder_step exported with decode_moe "gathered"): the loop's result in fp32, and in
    bf16 within the §7 bound of the loop's own bf16 error."""
    moe = tiny_model.layers[0].ffn
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(rows, tiny_model.cfg.hidden_size, generator=gen)
            assert_close(gathered_moe(moe, x), loop_moe(moe, x), OP_FP32, f"gathered dispatch, {rows} rows")
        exact = loop_moe(moe, x)
        low = copy.deepcopy(moe).to(torch.bfloat16)
        xb = x.to(torch.bfloat16)
        err_loop = (loop_moe(low, xb) - exact).abs().max().item()
        err_gathered = (gathered_moe(low, xb) - exact).abs().max().item()
    assert err_gathered <= kernel_bound(err_loop, torch.bfloat16), (err_gathered, err_loop)


@pytest.mark.parametrize("rows", [1, 5])
def test_grouped_o_projection_is_each_groups_own_map(tiny_model, gen, rows):
    attn = tiny_model.layers[0].attn
    cfg = tiny_model.cfg
    o = torch.randn(2, rows, cfg.num_attention_heads, cfg.head_dim, generator=gen)
    with torch.no_grad():
        got = attn._project_out(o)
        groups = o.flatten(-2).chunk(cfg.o_groups, dim=-1)
        wa = attn.wo_a.weight.chunk(cfg.o_groups, dim=0)  # group g's rows of wo_a
        z = torch.cat([g @ w.T for g, w in zip(groups, wa, strict=True)], dim=-1)
        assert_close(got, attn.wo_b(z), OP_FP32, f"o-projection, {rows} rows")


def test_experts_live_in_one_stacked_tensor_through_conversion_and_loading(tiny_cfg, tmp_path):
    """The dense dispatch reads the routed experts where they are: each expert's weight is a row
    of one [E, ...] tensor per layer, after construction, a dtype conversion and a safetensors
    round trip (which must still write each expert as a tensor of its own)."""
    from dsflash.model.model import DSFlashModel
    from dsflash.model.weights import load_safetensors, save_safetensors

    model = DSFlashModel(tiny_cfg).init_weights(seed=5).eval()
    path = tmp_path / "w.safetensors"
    save_safetensors(model, path)
    model = model.to(torch.bfloat16)
    moe = model.layers[0].ffn

    def rows_of_the_stack():
        w1, w3, w2 = moe.stacked_weights()
        for stacked, name in ((w1, "w1"), (w3, "w3"), (w2, "w2")):
            for i, e in enumerate(moe.experts):
                assert getattr(e, name).weight.data_ptr() == stacked[i].data_ptr(), (name, i)
        return w1

    w1 = rows_of_the_stack()
    assert w1.dtype == torch.bfloat16
    fresh = DSFlashModel(tiny_cfg).eval().to(torch.bfloat16)
    load_safetensors(fresh, path)
    moe = fresh.layers[0].ffn
    rows_of_the_stack()
    want = DSFlashModel(tiny_cfg).init_weights(seed=5).eval().layers[0].ffn.experts[1].w3.weight
    assert torch.equal(moe.experts[1].w3.weight, want.to(torch.bfloat16))
    # a parameter replaced by assignment is no longer a row: the dispatch stacks afresh
    moe.experts[0].w1.weight = torch.nn.Parameter(moe.experts[0].w1.weight.detach().clone() + 1)
    assert torch.equal(moe.stacked_weights()[0][0], moe.experts[0].w1.weight)


def _traced_call_targets(module, x) -> list[str]:
    """The functions a torch.compile trace of `module(x)` calls (one graph, run as traced)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=record, fullgraph=True)(x)
    assert len(graphs) == 1
    return [str(n.target) for n in graphs[0].graph.nodes if n.op in ("call_function", "call_method")]


def test_a_runtime_trace_reads_the_expert_stack_and_export_stacks_the_parameters(tiny_cfg, gen):
    """torch.compile (the torch-compiled backend) traces the dispatch over the stored stack (for
    one row, only the routed experts); only inside export_form (the ONNX export) does the module
    hold the stacks as three parameters instead of E experts (torch.export lifts every parameter,
    and its decomposition is quadratic in their count) and take one MatMul over [E*I, H]. Both
    give the eager result, and leaving export_form restores the experts' parameters, names and
    order included. Keyed on torch.compiler.is_exporting(), torch 2.11's compile trace took the
    export form and copied all experts every step; the flag is explicit now."""
    from dsflash.model.model import DSFlashModel
    from dsflash.model.moe import export_form

    model = DSFlashModel(tiny_cfg).init_weights(seed=3).eval()
    moe = model.layers[0].ffn
    x = torch.randn(1, 3, tiny_cfg.hidden_size, generator=gen)
    with torch.no_grad():
        want = loop_moe(moe, x[0])
        runtime = _traced_call_targets(moe, x)
        before = [(name, p) for name, p in model.named_parameters()]
        with export_form(model):
            assert moe.for_export
            exported = _traced_call_targets(moe, x)
            assert_close(moe(x)[0].float(), want, OP_FP32, "export form")
            inside = dict(moe.named_parameters())
        assert not moe.for_export
        assert [(n, id(p)) for n, p in model.named_parameters()] == [(n, id(p)) for n, p in before]
        assert not any(n.startswith("experts.") for n in inside)
        assert [inside[f"routed_{w}"].shape for w in ("w1", "w3", "w2")] == [
            (len(moe.experts), *moe.experts[0].w1.weight.shape),
            (len(moe.experts), *moe.experts[0].w3.weight.shape),
            (len(moe.experts), *moe.experts[0].w2.weight.shape)]
        # the stacked parameters are the experts' own storage, not a copy
        assert inside["routed_w2"].data_ptr() == moe.experts[0].w2.weight.data_ptr()
        assert_close(torch.compile(moe, backend="eager", fullgraph=True)(x)[0].float(), want, OP_FP32,
                     "traced runtime form")
    assert "stack" not in " ".join(runtime + exported), (runtime, exported)
    # one row: the k routed experts only (no dense routing weights scattered over all E)
    one = x[:, :1]
    with torch.no_grad():
        one_row = _traced_call_targets(moe, one)
        assert_close(torch.compile(moe, backend="eager", fullgraph=True)(one)[0].float(),
                     loop_moe(moe, one[0]), OP_FP32, "traced one-row form")
    assert any("scatter" in t for t in runtime) and not any("scatter" in t for t in one_row)
    torch._dynamo.reset()
