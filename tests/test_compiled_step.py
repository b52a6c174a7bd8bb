"""The decode step under torch.compile (TorchEngine(compile=...), the torch-compiled backend): the
Triton launchers as torch.library ops (plugins/triton_ops.py) that a trace keeps opaque, their
fakes against the launchers, and one traced graph per decode step that holds every kernel and
gives the eager kernels' results. On the CPU the kernels run in the Triton interpreter (fp32) and
the trace runs as traced (no code generation); inductor itself runs in the GPU tests."""

from __future__ import annotations

import pytest
import torch
from test_plugin_schema import sample_inputs

from dsflash.plugins.registry import DECLS, OpSet

from tolerances import MODEL, assert_close

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

KERNEL_DECLS = [d for d in DECLS if d.torch_name in
                ("engram_hash_gather", "csa2_index_score", "csa2_sparse_attention", "mhc_boundary",
                 "csa2_entries_fp4")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _on_device(inputs):
    return tuple(t.to(DEVICE) for t in inputs)


@pytest.mark.parametrize("decl", KERNEL_DECLS, ids=lambda d: d.name)
def test_triton_op_runs_the_launcher_and_its_fake_agrees(decl, gen):
    ops = OpSet("triton")  # registers torch.ops.dsflash_triton.*
    inputs, attrs = sample_inputs(decl, gen)
    inputs = _on_device(inputs)
    op = getattr(torch.ops.dsflash_triton, decl.torch_name)
    got = op(*inputs, *attrs.values())
    want = ops._kernels[decl.torch_name](*inputs, **attrs)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want) == len(decl.outputs)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    torch.library.opcheck(op, (*inputs, *attrs.values()), test_utils=("test_schema", "test_faketensor"))


def test_triton_topk_op_runs_the_launcher_and_its_fake_agrees(gen):
    ops = OpSet("triton")
    scores = torch.randn(2, 3, 37, generator=gen).to(DEVICE)
    scores[0, 1, 5:] = float("-inf")  # fewer visible than k
    vals, idx = torch.ops.dsflash_triton.stable_topk(scores, 9)
    want_vals, want_idx = ops._kernels["stable_topk"](scores, 9)
    assert torch.equal(vals, want_vals) and torch.equal(idx, want_idx)
    assert vals.shape == (2, 3, 9) and vals.dtype == torch.float32 and idx.dtype == torch.int64
    torch.library.opcheck(torch.ops.dsflash_triton.stable_topk, (scores, 9),
                          test_utils=("test_schema", "test_faketensor"))
    # k over the row: min(k, N) columns, in the fake as in the launcher
    assert torch.ops.dsflash_triton.stable_topk(scores, 50)[0].shape == (2, 3, 37)
    torch.library.opcheck(torch.ops.dsflash_triton.stable_topk, (scores, 50),
                          test_utils=("test_faketensor",))


def test_triton_pooled_score_op_runs_the_launcher_and_its_fake_agrees(gen):
    """The listed pool's index scores as `torch.ops.dsflash_triton.csa2_index_score_pooled`, which a
    compiled step holds as an opaque op like the other kernels (the listing and the picks stay
    PyTorch ops there)."""
    ops = OpSet("triton")
    q, w = torch.randn(2, 1, 3, 16, generator=gen), torch.randn(2, 1, 3, generator=gen)
    k = torch.randn(2, 50, 16, generator=gen)
    entries = torch.randint(-1, 50, (2, 1, 21), generator=gen, dtype=torch.int32)
    q, w, k, entries = _on_device((q, w, k, entries))
    got = torch.ops.dsflash_triton.csa2_index_score_pooled(q, w, k, entries)
    assert torch.equal(got, ops._kernels["csa2_index_score_pooled"](q, w, k, entries))
    assert got.shape == (2, 1, 21) and got.dtype == torch.float32
    torch.library.opcheck(torch.ops.dsflash_triton.csa2_index_score_pooled, (q, w, k, entries),
                          test_utils=("test_schema", "test_faketensor"))


class GraphRecorder:
    """A torch.compile backend that keeps each traced graph and runs it as traced."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def kernel_calls(self, i: int) -> list[str]:
        return [str(n.target).split(".")[1] for n in self.graphs[i].graph.nodes
                if n.op == "call_function" and str(n.target).startswith("dsflash_triton.")]


def test_compiled_decode_step_is_one_graph_of_the_kernels(tiny_cfg):
    """Batches of 1, 2 and 3 sequences: one graph for batch 1 and one with a symbolic batch for
    the others (dynamic=True), each holding the step's kernels as opaque ops, with the eager
    kernels' results (MODEL: the same maths in another order)."""
    from dsflash.model.model import DSFlashModel
    from dsflash.runtime.cache_manager import synthetic_cache
    from dsflash.runtime.engine import TorchEngine

    torch._dynamo.reset()
    model = DSFlashModel(tiny_cfg).init_weights(seed=7).eval().to(DEVICE)
    recorder = GraphRecorder()
    compiled = TorchEngine(model, "decoder_step", ops="triton", compile=recorder)
    eager = TorchEngine(model, "decoder_step", ops="triton")
    for batch, context in ((1, 40), (2, 40), (3, 21)):
        cm = synthetic_cache(tiny_cfg, batch, context, 2, DEVICE, torch.float32, seed=batch)
        ids = torch.randint(0, tiny_cfg.vocab_size, (batch, 1))
        feeds = cm.feeds(list(range(batch)), compiled.input_names, ids)
        got, want = compiled.run(feeds), eager.run(feeds)
        for name in compiled.output_names:  # the trace's decompositions reorder some sums
            assert_close(got[name].float(), want[name].float(), MODEL, f"batch {batch}: {name}")
    assert len(recorder.graphs) == 2
    # the eager step's launcher calls, counted, against each graph's opaque ops
    counts = {}

    def counting(name, launcher):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return launcher(*args, **kwargs)
        return call

    model.ops._kernels = {n: counting(n, f) for n, f in model.ops._kernels.items()}
    eager.run(feeds)
    assert set(counts) == {"engram_hash_gather", "csa2_index_score", "csa2_index_score_pooled",
                           "csa2_sparse_attention", "mhc_boundary", "stable_topk", "pool_entry_list",
                           "listed_topk", "listed_maxima_block"}
    # listing the pool stays PyTorch ops in a traced graph (inductor fuses them), and so does
    # mapping a listed top-k's picks back: the eager step's listed top-k (one launcher call writing
    # the ids) is the top-k op there; every other kernel call is one opaque op
    counts.pop("pool_entry_list")
    counts.pop("listed_maxima_block")  # a launch plan's question (0: INDEX_MAXIMA off), no launch
    counts["stable_topk"] += counts.pop("listed_topk")
    for i in range(2):
        calls = recorder.kernel_calls(i)
        assert {n: calls.count(n) for n in set(calls)} == counts
    torch._dynamo.reset()


def test_compiled_decode_step_reads_the_kv_qat_state(tiny_cfg):
    """A kv_qat model's traced step over its FP4 state (entries: codes + e4m3 scales, index keys:
    codes + exponents): Csa2EntriesFp4 and Csa2IndexScoreFp4 as opaque ops, the eager kernels'
    results."""
    from dsflash.model.model import DSFlashModel
    from dsflash.runtime.cache_manager import synthetic_cache
    from dsflash.runtime.engine import TorchEngine

    cfg = tiny_cfg.replace(kv_qat=True, index_head_dim=32)
    torch._dynamo.reset()
    model = DSFlashModel(cfg).init_weights(seed=7).eval().to(DEVICE)
    recorder = GraphRecorder()
    compiled = TorchEngine(model, "decoder_step", ops="triton", compile=recorder)
    eager = TorchEngine(model, "decoder_step", ops="triton")
    cm = synthetic_cache(cfg, 2, 40, 2, DEVICE, torch.float32, seed=5)
    feeds = cm.feeds([0, 1], compiled.input_names, torch.randint(0, cfg.vocab_size, (2, 1)))
    got, want = compiled.run(feeds), eager.run(feeds)
    for name in compiled.output_names:
        assert_close(got[name].float(), want[name].float(), MODEL, f"kv_qat: {name}")
    calls = recorder.kernel_calls(0)
    assert {"csa2_entries_fp4", "csa2_index_score_fp4"} <= set(calls), calls
    torch._dynamo.reset()


def test_torch_compiled_backend_compiles_the_decode_step_only(tiny_cfg):
    """make_engines("torch-compiled"): the Triton kernels for both graphs, the decode step behind
    torch.compile (inductor), prefill eager; an unknown backend names the known ones."""
    from dsflash.model.model import DSFlashModel
    from dsflash.runtime.engine import BACKENDS, make_engines

    model = DSFlashModel(tiny_cfg).init_weights(seed=7).eval().to(DEVICE)
    engines = make_engines("torch-compiled", model=model)
    assert model.ops.backend == "triton"
    decode, prefill = engines["decoder_step"], engines["encoder_prefill"]
    assert decode._step is not decode.module and hasattr(decode._step, "_torchdynamo_orig_callable")
    assert prefill._step is prefill.module
    assert "torch-compiled" in BACKENDS
    make_engines("torch", model=model)  # the same model back on the reference ops
    assert model.ops.backend == "reference"
    with pytest.raises(ValueError, match="unknown backend 'torch-inductor'; backends: .*torch-compiled"):
        make_engines("torch-inductor", model=model)


def test_kernel_engines_on_the_cpu_need_the_interpreter(tiny_cfg, monkeypatch):
    """Without CUDA and without TRITON_INTERPRET=1 a kernel engine refuses at construction,
    before any compile, naming the device and the way out."""
    from dsflash.model.model import DSFlashModel
    from dsflash.runtime.engine import make_engines

    model = DSFlashModel(tiny_cfg).eval()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for backend in ("torch-triton", "torch-compiled"):
        with pytest.raises(ValueError,
                           match=r"need the model on a CUDA device, not cpu \(or TRITON_INTERPRET=1"):
            make_engines(backend, model=model)


def test_compile_options_are_inductor_settings(tiny_cfg):
    """compile_options reach inductor's settings at construction (an unknown one is refused
    there, not after a trace); with another compile backend, or through make_engines for another
    runtime backend, they are refused by name."""
    from dsflash.model.model import DSFlashModel
    from dsflash.runtime.engine import TUNED_COMPILE, TorchEngine, make_engines

    model = DSFlashModel(tiny_cfg).init_weights(seed=7).eval().to(DEVICE)
    engine = TorchEngine(model, "decoder_step", ops="triton", compile="inductor",
                         compile_options={"max_autotune_gemm": True})
    assert engine._step is not engine.module
    with pytest.raises(RuntimeError, match="max_autotune_gem"):
        TorchEngine(model, "decoder_step", ops="triton", compile="inductor",
                    compile_options={"max_autotune_gem": True})
    with pytest.raises(ValueError, match=r"compile_options \['max_autotune_gemm'\] are inductor settings"):
        TorchEngine(model, "decoder_step", ops="triton", compile=lambda gm, inputs: gm.forward,
                    compile_options={"max_autotune_gemm": True})
    # make_engines hands them to the compiled decode step only, and to no other backend
    engines = make_engines("torch-compiled", model=model, compile_options=TUNED_COMPILE)
    assert engines["decoder_step"]._step is not engines["decoder_step"].module
    with pytest.raises(RuntimeError, match="coordinate_descent_tunin"):
        make_engines("torch-compiled", model=model, compile_options={"coordinate_descent_tunin": True})
    with pytest.raises(ValueError, match="are for the torch-compiled backend, not 'torch-triton'"):
        make_engines("torch-triton", model=model, compile_options=TUNED_COMPILE)
    torch._dynamo.reset()
