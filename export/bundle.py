"""Bundles: `engines/<name>/` with the ONNX graphs, one shared weights file, config.json and
manifest.json (model config, state contract, per graph and flavor the I/O names / dtypes /
dynamic dims, sha256 of every file, versions, creation time). `Bundle.open` verifies the hashes
and each graph's I/O against the manifest and the contract, naming the first difference.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from dsflash.export.contract import GRAPHS, contract_dict, graph_inputs, graph_outputs
from dsflash.model.config import ModelConfig

log = logging.getLogger(__name__)
MANIFEST_FORMAT = 1
SERVED_DTYPES = ("float32", "bfloat16")  # the model dtypes a bundle may declare
ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 7: "int64", 9: "bool", 10: "float16", 16: "bfloat16"}


class BundleError(ValueError):
    """A bundle that does not match its manifest or the contract."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def graph_file(graph: str, flavor: str) -> str:
    return f"{graph}.{flavor}.onnx"


def onnx_io(proto) -> dict:
    """Inputs and outputs of an ONNX graph: name, dtype, shape (ints or dimension names)."""
    def describe(values):
        out = []
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]
            out.append({"name": v.name, "dtype": ONNX_DTYPES.get(t.elem_type, str(t.elem_type)),
                        "shape": dims})
        return out

    return {"inputs": describe(proto.graph.input), "outputs": describe(proto.graph.output)}


def custom_nodes(proto) -> list[str]:
    from dsflash.plugins.declaration import DOMAIN

    return sorted({n.op_type for n in proto.graph.node if n.domain == DOMAIN})


def first_io_difference(actual: dict, expected: dict) -> str | None:
    """Compare two `onnx_io` descriptions; None when equal, else the first difference."""
    for side in ("inputs", "outputs"):
        a, e = actual[side], expected[side]
        for i, (x, y) in enumerate(zip(a, e)):
            for key in ("name", "dtype"):
                if x[key] != y[key]:
                    return f"{side[:-1]} {i}: {key} {x[key]!r} != expected {y[key]!r}"
            if len(x["shape"]) != len(y["shape"]):
                return f"{side[:-1]} {i} ({x['name']}): rank {len(x['shape'])} != expected {len(y['shape'])}"
            for j, (dx, dy) in enumerate(zip(x["shape"], y["shape"])):
                if isinstance(dy, int) and dy and dx != dy:
                    return f"{side[:-1]} {i} ({x['name']}): dim {j} is {dx!r}, expected {dy}"
                if isinstance(dy, str) and not isinstance(dx, str):
                    return f"{side[:-1]} {i} ({x['name']}): dim {j} is static {dx}, expected dynamic"
        if len(a) != len(e):
            return f"{len(a)} {side} != expected {len(e)}"
    return None


def contract_io(cfg: ModelConfig, graph: str, dtype: str = "float32") -> dict:
    """The I/O the contract prescribes, in `onnx_io` form (dynamic dims as their names)."""
    from dsflash.model.cache import static_dims

    dims = static_dims(cfg)

    def describe(tensors):
        return [{"name": t.name, "dtype": dtype if t.dtype == "model" else t.dtype,
                 "shape": [int(d) if d.isdigit() else dims.get(d, d) for d in t.shape]}
                for t in tensors]

    return {"inputs": describe(graph_inputs(cfg, graph)), "outputs": describe(graph_outputs(cfg, graph))}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "onnx", "onnxruntime", "onnxscript", "dsflash"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


@dataclass
class Bundle:
    path: Path
    manifest: dict
    config: ModelConfig

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> Bundle:
        path = Path(path)
        mpath = path / "manifest.json"
        if not mpath.is_file():
            raise BundleError(f"{path} is not a bundle: manifest.json is missing")
        manifest = json.loads(mpath.read_text())
        if manifest.get("format") != MANIFEST_FORMAT:
            raise BundleError(f"manifest format {manifest.get('format')!r}; this dsflash reads "
                              f"{MANIFEST_FORMAT}")
        bundle = cls(path, manifest, ModelConfig.from_dict(manifest["config"]))
        if verify:
            bundle.verify()
        return bundle

    @property
    def dtype(self):
        """The graphs' model dtype (torch.float32 / torch.bfloat16): their weights, activations
        and the state the contract marks `model`."""
        import torch

        name = self.manifest.get("dtype")
        if name not in SERVED_DTYPES:
            raise BundleError(f"bundle {self.path} has dtype {name!r}; dsflash serves {SERVED_DTYPES}")
        return getattr(torch, name)

    @property
    def decode_attention(self) -> str:
        """decoder_step's attention nodes in the plugin flavor ("split" or "single";
        export/onnx_export.py:DECODE_ATTENTION_FORMS); bundles from before the option: "split"."""
        from dsflash.export.onnx_export import DECODE_ATTENTION_FORMS

        form = self.manifest.get("export_options", {}).get("decode_attention", "split")
        if form not in DECODE_ATTENTION_FORMS:
            raise BundleError(f"bundle {self.path} has decode_attention {form!r}; forms: "
                              f"{DECODE_ATTENTION_FORMS}")
        return form

    @property
    def decode_moe(self) -> str:
        """decoder_step's routed-expert dispatch ("dense" or "gathered";
        export/onnx_export.py:DECODE_MOE_FORMS); bundles from before the option: "dense"."""
        from dsflash.export.onnx_export import DECODE_MOE_FORMS

        form = self.manifest.get("export_options", {}).get("decode_moe", "dense")
        if form not in DECODE_MOE_FORMS:
            raise BundleError(f"bundle {self.path} has decode_moe {form!r}; forms: {DECODE_MOE_FORMS}")
        return form

    @property
    def flavors(self) -> list[str]:
        return sorted({f for g in self.manifest["graphs"].values() for f in g})

    def graph_path(self, graph: str, flavor: str) -> Path:
        try:
            entry = self.manifest["graphs"][graph][flavor]
        except KeyError:
            raise BundleError(f"bundle {self.path} has no {flavor!r} {graph!r} graph; flavors: "
                              f"{self.flavors}") from None
        return self.path / entry["file"]

    def verify(self) -> None:
        """Every file's sha256, then each graph's I/O against the manifest and the contract."""
        import onnx

        for name, digest in self.manifest["files"].items():
            fpath = self.path / name
            if not fpath.is_file():
                raise BundleError(f"bundle file {name} is missing from {self.path}")
            if sha256_file(fpath) != digest:
                raise BundleError(f"bundle file {name} does not match its sha256 in the manifest "
                                  "(modified or corrupted)")
        for graph, flavors in self.manifest["graphs"].items():
            for flavor, entry in flavors.items():
                proto = onnx.load(str(self.path / entry["file"]), load_external_data=False)
                self.check_io(graph, flavor, onnx_io(proto))

    def check_io(self, graph: str, flavor: str, actual: dict) -> None:
        entry = self.manifest["graphs"][graph][flavor]
        for expected, what in ((entry["io"], "the manifest"),
                               (contract_io(self.config, graph, self.manifest["dtype"]), "the contract")):
            diff = first_io_difference(actual, expected)
            if diff:
                raise BundleError(f"{graph} ({flavor}) does not match {what}: {diff}")


def model_dtype_name(model) -> str:
    """A model's dtype as the manifest names it ("float32", "bfloat16"): its embedding's."""
    return str(model.embed.weight.dtype).removeprefix("torch.")


def _export_worker(cfg_dict: dict, vocab_map, weights: str, dtype: str, options, graph: str,
                   flavor: str) -> bytes:
    """Export one graph in a fresh process (weights handed over as a safetensors file), in the
    parent model's dtype: a bf16 model exports bf16 graphs from any number of workers."""
    import torch

    from dsflash.export.onnx_export import export_graph
    from dsflash.model.model import DSFlashModel
    from dsflash.model.weights import load_safetensors

    model = DSFlashModel(ModelConfig.from_dict(cfg_dict), vocab_map=vocab_map).eval()
    load_safetensors(model.to(getattr(torch, dtype)), weights)
    return export_graph(model, graph, flavor, options).SerializeToString()


def _export_all(model, jobs: list[tuple[str, str]], workers: int, progress, options) -> dict:
    import onnx

    from dsflash.export.onnx_export import export_graph

    if workers <= 1:
        protos = {}
        for graph, flavor in jobs:
            if progress:
                progress(f"exporting {graph} ({flavor})")
            protos[(graph, flavor)] = export_graph(model, graph, flavor, options)
        return protos
    import multiprocessing as mp
    import tempfile
    from concurrent.futures import ProcessPoolExecutor

    from dsflash.model.weights import save_safetensors

    with tempfile.TemporaryDirectory() as tmp:
        weights = str(Path(tmp) / "weights.safetensors")
        save_safetensors(model, weights)
        vocab = model.engram_vocab_map.cpu().numpy()
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            dtype = model_dtype_name(model)
            futures = {job: pool.submit(_export_worker, model.cfg.to_dict(), vocab, weights, dtype,
                                        options, *job) for job in jobs}
            protos = {}
            for job, fut in futures.items():
                protos[job] = onnx.ModelProto.FromString(fut.result())
                if progress:
                    progress(f"exported {job[0]} ({job[1]})")
    return protos


def write_bundle(model, out_dir: str | Path, name: str, flavors: tuple[str, ...],
                 progress: Callable[[str], None] | None = None, workers: int = 1,
                 decode_attention: str = "split", decode_moe: str = "dense") -> Bundle:
    """Export every graph in every flavor (in `workers` processes), share the weights, write
    config and manifest. `decode_attention`: decoder_step's attention nodes in the plugin flavor;
    `decode_moe`: decoder_step's routed experts, dense or gathered (export/onnx_export.py:
    ExportOptions, checked before anything is written), recorded in the manifest's export_options."""
    import onnx

    from dsflash.export.onnx_export import ExportOptions, write_shared_weights

    options = ExportOptions(decode_attention, decode_moe)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    t0 = time.time()
    jobs = [(g, f) for f in flavors for g in GRAPHS]
    protos = _export_all(model, jobs, workers, progress, options)
    write_shared_weights(protos, out)
    graphs: dict = {g: {} for g in GRAPHS}
    for (graph, flavor), proto in protos.items():
        fname = graph_file(graph, flavor)
        onnx.save(proto, str(out / fname))
        graphs[graph][flavor] = {"file": fname, "io": onnx_io(proto), "custom_ops": custom_nodes(proto),
                                 "opset": {i.domain or "ai.onnx": i.version for i in proto.opset_import},
                                 "ir_version": proto.ir_version}
    cfg.to_json(out / "config.json")
    dtype = model_dtype_name(model)
    files = sorted([graph_file(g, f) for g, f in protos] + ["weights.bin", "config.json"])
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    manifest = {"format": MANIFEST_FORMAT, "name": name, "created": created,
                "export_seconds": round(time.time() - t0, 1), "dtype": dtype, "versions": versions(),
                "config": cfg.to_dict(), "contract": contract_dict(cfg),
                "export_options": options.as_dict(), "graphs": graphs,
                "files": {f: sha256_file(out / f) for f in files}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    bundle = Bundle.open(out)
    log.info("bundle %s written to %s", name, out)
    return bundle
