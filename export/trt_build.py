"""TensorRT plans from a bundle's plugin-flavor graphs (PIPELINE.md §6).

`preflight` lists the custom nodes of a graph and checks each against the plugin registry
(op, namespace, version, attributes) before anything is parsed, naming what is missing, and
refuses fp64 tensors (`fp64_sources`); it needs no TensorRT. `optimization_profiles` derives
min/opt/max shapes from the contract. `build_plan` needs the full TensorRT builder (not
installable on the project's machines): it imports the
plugin registrations, builds a strongly typed network with the profiles and a timing cache, and
writes `plans/<graph>.plan` plus the sidecar `plans/plans.json` that TrtEngine checks on load.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import onnx

from dsflash.export.bundle import Bundle, BundleError, sha256_file
from dsflash.export.contract import graph_inputs
from dsflash.plugins.declaration import DOMAIN

LOG = logging.getLogger(__name__)
PLAN_DIR = "plans"
SIDECAR = "plans.json"


def fp64_sources(proto) -> list[str]:
    """Where fp64 values enter a graph: its fp64 inputs and initializers, and the outputs of
    Constant / ConstantOfShape nodes with fp64 values and of casts to fp64. Every other fp64
    value is computed from one of these."""
    dbl = onnx.TensorProto.DOUBLE
    graph = proto.graph
    names = [v.name for v in graph.input if v.type.tensor_type.elem_type == dbl]
    names += [t.name for t in graph.initializer if t.data_type == dbl]
    for node in graph.node:
        attrs = {a.name: a for a in node.attribute}
        if ((node.op_type == "Cast" and attrs["to"].i == dbl)
                or (node.op_type in ("Constant", "ConstantOfShape") and "value" in attrs
                    and attrs["value"].t.data_type == dbl)):
            names.append(node.output[0])
    return names


def preflight(proto) -> list[str]:
    """The custom node types of a graph; raises BundleError naming any node the registry lacks
    or whose namespace, version or attributes differ from the declaration, or the first fp64
    tensor: TensorRT has no fp64 type, and its ONNX parser turns fp64 casts and weights into
    fp32 ones without an error (onnx-tensorrt `convertDtype`: DOUBLE -> kFLOAT), so a plan would
    compute in another precision than the graph checked against PyTorch."""
    from dsflash.plugins.registry import DECLS

    fp64 = fp64_sources(proto)
    if fp64:
        raise BundleError(f"{len(fp64)} fp64 tensors (first: {fp64[0]!r}); TensorRT has no fp64 type "
                          "and its parser would demote them to fp32: export the graph without them")
    decls = {d.name: d for d in DECLS}
    seen = []
    for node in proto.graph.node:
        if node.domain in ("", "ai.onnx"):
            continue
        if node.domain != DOMAIN:
            raise BundleError(f"node {node.name} ({node.op_type}) is in domain {node.domain!r}; "
                              f"TensorRT gets plugins from {DOMAIN!r} only")
        decl = decls.get(node.op_type)
        if decl is None:
            raise BundleError(f"node {node.name}: no plugin registered for {DOMAIN}::{node.op_type}; "
                              f"registered: {sorted(decls)}")
        attrs = {a.name: a for a in node.attribute}
        ns = attrs.get("plugin_namespace")
        version = attrs.get("plugin_version")
        if ns is None or ns.s.decode() != DOMAIN or version is None or version.s.decode() != decl.version:
            raise BundleError(f"node {node.name} ({node.op_type}): plugin_namespace/plugin_version must be "
                              f"{DOMAIN!r}/{decl.version!r}")
        missing = [a.name for a in decl.attrs if a.name not in attrs]
        if missing:
            raise BundleError(f"node {node.name} ({node.op_type}) lacks attributes {missing}")
        if node.op_type not in seen:
            seen.append(node.op_type)
    return seen


def optimization_profiles(bundle: Bundle, graph: str, max_batch: int, capacity: int, max_rows: int,
                          opt_batch: int | None = None) -> dict[str, tuple[tuple, tuple, tuple]]:
    """input -> (min, opt, max) shapes: rows 1 .. max_rows (prefill chunk or decode step), batch
    1 .. max_batch, compressed entries from the capacity; opt at the decode-typical point: one row
    a sequence, opt_batch sequences (default max_batch).

    TensorRT times each plugin's tactics at the opt shapes only, and an engine keeps those picks
    for every batch of the profile. Where they differ most: decoder_step's split attention node
    is fastest with the Triton decode blocks at 1-2 rows and with the Gluon kernel from 4 (H100,
    both nodes: one row 8.1 against 9.9 us, 8 rows 16.0 against 13.4, 64 rows 81.4 against 34.1;
    docs/benchmarks.md, session 39), so opt_batch should be the batch a deployment serves most."""
    cfg = bundle.config
    opt_batch = max_batch if opt_batch is None else opt_batch
    if max_rows < 1 or max_batch < 1 or capacity < max_rows:
        raise ValueError(f"profile needs max_batch >= 1, max_rows >= 1 and capacity >= max_rows; got "
                         f"{max_batch}, {max_rows}, {capacity}")
    if not 1 <= opt_batch <= max_batch:
        raise ValueError(f"profile needs 1 <= opt_batch <= max_batch; got opt_batch {opt_batch}, "
                         f"max_batch {max_batch}")
    opt_rows = 1 if graph == "decoder_step" else max_rows
    return {t.name: (t.resolve(cfg, 1, capacity, 1), t.resolve(cfg, opt_batch, capacity, opt_rows),
                     t.resolve(cfg, max_batch, capacity, max_rows)) for t in graph_inputs(cfg, graph)}


def decode_attention_advice(bundle: Bundle, opt_rows: int) -> str | None:
    """A line for the build log where the bundle's decoder_step attention form (the export's
    --decode-attention) is the slower one at `opt_rows` query rows per step (the profiles' opt
    batch: a decode step has one row per sequence), by the crossover measured on an H100
    (export/onnx_export.py); None otherwise."""
    from dsflash.export.onnx_export import SINGLE_ATTENTION_FROM_ROWS, SPLIT_ATTENTION_UP_TO_ROWS

    if opt_rows < 1:
        raise ValueError(f"opt_rows must be >= 1, got {opt_rows}")
    form = bundle.decode_attention
    if form == "split" and opt_rows >= SINGLE_ATTENTION_FROM_ROWS:
        better, why = "single", f"one node is faster from {SINGLE_ATTENTION_FROM_ROWS} rows"
    elif form == "single" and opt_rows <= SPLIT_ATTENTION_UP_TO_ROWS:
        better, why = "split", f"the split pair is faster up to {SPLIT_ATTENTION_UP_TO_ROWS} rows"
    else:
        return None
    return (f"decoder_step's attention is in the {form!r} form, tuned here for {opt_rows} rows per step; "
            f"{why} (H100): a bundle exported with --decode-attention {better} would serve this batch faster")


def decode_moe_advice(bundle: Bundle, opt_rows: int, max_rows: int) -> list[str]:
    """Lines for the build log on the bundle's decoder_step MoE dispatch (the export's --decode-moe)
    at `opt_rows` rows per step (the profiles' opt) and `max_rows` (their max: batch x step rows).
    Counted bytes, per MoE layer and step: dense reads all E experts' three matrices; gathered
    reads each row's k, writes the copies and reads them again (3 passes), so it moves fewer while
    rows < E / (3k) (flash: 21.3; an H100 timed the crossover between 16 and 32 rows,
    scripts/bench_moe_dispatch.py), and its copies take rows x k x 3 matrices of activation memory
    at max_rows."""
    if not 1 <= opt_rows <= max_rows:
        raise ValueError(f"need 1 <= opt_rows <= max_rows; got opt_rows {opt_rows}, max_rows {max_rows}")
    cfg = bundle.config
    experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    if not experts:
        return []
    matrix = cfg.moe_intermediate_size * cfg.hidden_size * bundle.dtype.itemsize
    crossover = experts / (3 * k)
    ratio = 3 * opt_rows * k / experts  # gathered bytes / dense bytes
    form, lines = bundle.decode_moe, []
    if form == "dense" and opt_rows < crossover:
        lines.append(f"decoder_step runs its {experts} routed experts densely; at {opt_rows} rows per "
                     f"step a bundle exported with --decode-moe gathered would move "
                     f"{ratio:.2f}x the expert bytes (fewer below {crossover:.1f} rows)")
    if form == "gathered":
        if opt_rows >= crossover:
            lines.append(f"decoder_step gathers each row's {k} experts; at {opt_rows} rows per step that "
                         f"moves {ratio:.2f}x the bytes of the dense form "
                         f"(--decode-moe dense is lighter from {crossover:.1f} rows)")
        lines.append(f"decoder_step's gathered experts take {max_rows * k * 3 * matrix / 2**30:.2f} GiB "
                     f"per MoE layer at the profile's {max_rows} rows")
    return lines


def build_plan(bundle: Bundle, graph: str, profiles: dict, timing_cache: Path | None = None) -> Path:
    """Build and write plans/<graph>.plan (needs the full `tensorrt` package and a GPU)."""
    import onnx
    import tensorrt as trt

    from dsflash.plugins.trt_register import register_trt_plugins

    path = bundle.graph_path(graph, "plugin")
    preflight(onnx.load(str(path), load_external_data=False))
    register_trt_plugins()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BundleError(f"TensorRT could not parse {path.name}: {errors}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in profiles.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    cache_bytes = timing_cache.read_bytes() if timing_cache and timing_cache.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    LOG.info("building %s (%d layers)", graph, network.num_layers)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise BundleError(f"TensorRT failed to build {graph}; see the log above")
    if timing_cache:
        timing_cache.write_bytes(memoryview(config.get_timing_cache().serialize()))
    out = bundle.path / PLAN_DIR / f"{graph}.plan"
    out.parent.mkdir(exist_ok=True)
    out.write_bytes(memoryview(plan))
    write_sidecar(bundle, graph, out, profiles, trt.__version__)
    return out


def write_sidecar(bundle: Bundle, graph: str, plan: Path, profiles: dict, trt_version: str) -> None:
    """What TrtEngine checks: the ONNX the plan came from, the plan's hash, profiles, versions."""
    side = bundle.path / PLAN_DIR / SIDECAR
    data = json.loads(side.read_text()) if side.is_file() else {}
    data[graph] = {"plan": plan.name, "plan_sha256": sha256_file(plan),
                   "onnx": bundle.graph_path(graph, "plugin").name,
                   "onnx_sha256": sha256_file(bundle.graph_path(graph, "plugin")),
                   "profiles": {k: [list(s) for s in v] for k, v in profiles.items()},
                   "tensorrt": trt_version}
    side.write_text(json.dumps(data, indent=1, sort_keys=True))
