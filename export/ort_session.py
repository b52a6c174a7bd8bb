"""ONNX Runtime sessions for a bundle's graphs. Plugin-flavor graphs get the custom ops'
ONNX Runtime implementations (dsflash.plugins.ort_ops); external weights resolve against the
bundle folder."""

from __future__ import annotations

from dsflash.export.bundle import Bundle, BundleError, onnx_io


def cuda_providers() -> list:
    """The CUDA provider as dsflash runs it (a fresh list each call: ONNX Runtime takes the options
    as a dict): use_tf32=0, since its fp32 MatMuls default to TF32 (a 10-bit mantissa), which is
    not the fp32 graph a bundle declares and changes greedy tokens."""
    return [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"]


def asks_for_cuda(providers) -> bool:
    """Whether an ONNX Runtime provider list (names or (name, options) pairs) names CUDA."""
    return any("CUDA" in str(p) for p in providers or [])


def require_cuda(session, what: str) -> None:
    """Refuse a session that asked for the CUDA provider and runs without it (onnxruntime
    without -gpu, or no GPU), instead of checking or serving on the CPU unnoticed."""
    if "CUDAExecutionProvider" not in session.get_providers():
        raise RuntimeError(f"{what}: ONNX Runtime did not enable the CUDA provider (enabled: "
                           f"{session.get_providers()}); is onnxruntime-gpu installed, with a GPU?")


def ort_session(bundle: Bundle, graph: str, flavor: str, providers: list[str] | None = None):
    import onnx
    import onnxruntime as ort

    path = bundle.graph_path(graph, flavor)
    proto = onnx.load(str(path), load_external_data=False)
    if flavor == "plugin":
        from dsflash.plugins.ort_ops import ort_plugin_model, ort_session_options

        opts = ort_session_options()
        proto = ort_plugin_model(proto)
    else:
        opts = ort.SessionOptions()
    # The model is handed over as bytes, so tell ONNX Runtime where weights.bin lives.
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                  str(bundle.path.resolve()))
    opts.log_severity_level = 3
    providers = providers or ["CPUExecutionProvider"]
    if asks_for_cuda(providers):
        # onnxruntime-gpu 1.31.1 reuses a buffer too early in these graphs: the tiny portable
        # decoder_step fails at a Where (condition [1,5,6] against values [1,5,37]) while the CPU
        # provider, or the same session with every intermediate made an output, runs it
        # correctly; without memory reuse it matches the CPU (H100, 2026-12-05, docs/benchmarks.md).
        # The same symptom and workaround: microsoft/onnxruntime#21942 and #21349.
        opts.enable_mem_reuse = False
    try:
        session = ort.InferenceSession(proto.SerializeToString(), opts, providers=providers)
    except Exception as e:  # onnxruntime raises its own NotImplemented (not Python's)
        if bundle.manifest.get("dtype") == "bfloat16" and "NOT_IMPLEMENTED" in str(e) and not any(
                "CUDA" in str(p) or "Tensorrt" in str(p) for p in providers):
            raise BundleError(
                f"{graph} ({flavor}) of {bundle.path} is bfloat16, and ONNX Runtime's CPU provider "
                f"has no bfloat16 kernel for some of its ops ({e}); run a bf16 bundle with the "
                "ort-cuda, trt or torch backend, or export the model in float32") from e
        raise
    actual = {"inputs": [{"name": i.name} for i in session.get_inputs()],
              "outputs": [{"name": o.name} for o in session.get_outputs()]}
    expected = onnx_io(onnx.load(str(path), load_external_data=False))
    names = ([i["name"] for i in actual["inputs"]], [o["name"] for o in actual["outputs"]])
    want = ([i["name"] for i in expected["inputs"]], [o["name"] for o in expected["outputs"]])
    if names != want:
        raise BundleError(f"session for {graph} ({flavor}) has I/O {names}, the graph declares {want}")
    return session
