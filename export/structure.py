"""Structure exports: every graph of a config, built on the meta device, written without weights
and checked against the state contract. For sizes whose weights cannot be materialised where the
export runs (the `flash` preset: 748 B parameters); a bundle needs the weights (export/bundle.py).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dsflash.export.bundle import BundleError, contract_io, first_io_difference, graph_file, onnx_io
from dsflash.export.contract import GRAPHS
from dsflash.model.config import ModelConfig
from dsflash.plugins.declaration import DOMAIN


@dataclass(frozen=True)
class StructureReport:
    """One exported graph: its file, ONNX node count, custom (plugin) nodes by type, seconds."""
    graph: str
    flavor: str
    path: Path
    nodes: int
    custom_nodes: dict[str, int]
    seconds: float


def _export_one(cfg_dict: dict, options, graph: str, flavor: str, path: str) -> StructureReport:
    """Export one graph's structure and check it (a worker process)."""
    from dsflash.export.onnx_export import export_structure

    cfg = ModelConfig.from_dict(cfg_dict)
    t0 = time.time()
    export_structure(cfg, graph, flavor, path, options)
    return check_structure(cfg, graph, flavor, path, time.time() - t0)


def check_structure(cfg: ModelConfig, graph: str, flavor: str, path: str | Path,
                    seconds: float = 0.0) -> StructureReport:
    """Report on an exported graph; BundleError naming the first difference where its I/O is
    not the contract's."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    diff = first_io_difference(onnx_io(proto), contract_io(cfg, graph))
    if diff:
        raise BundleError(f"{graph} ({flavor}) structure does not match the contract: {diff}")
    custom = Counter(n.op_type for n in proto.graph.node if n.domain == DOMAIN)
    return StructureReport(graph, flavor, Path(path), len(proto.graph.node), dict(custom), seconds)


def write_structures(cfg: ModelConfig, out_dir: str | Path, flavors: tuple[str, ...],
                     graphs: tuple[str, ...] = GRAPHS, workers: int = 1,
                     progress: Callable[[StructureReport], None] | None = None,
                     decode_attention: str = "split", decode_moe: str = "dense") -> list[StructureReport]:
    """Export the graphs in every flavor to `<out_dir>/<graph>.<flavor>.onnx` (no initializers),
    in `workers` processes; each graph's I/O must equal the contract's (BundleError otherwise).
    Worker processes also bound memory: the flash decode step's export holds 3-4 GB.
    `decode_attention`, `decode_moe`: how decoder_step is exported (as write_bundle's)."""
    from dsflash.export.onnx_export import ExportOptions

    options = ExportOptions(decode_attention, decode_moe)
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    unknown = [g for g in graphs if g not in GRAPHS]
    if unknown:
        raise ValueError(f"unknown graphs {unknown}; graphs: {GRAPHS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(graph, flavor, str(out / graph_file(graph, flavor))) for flavor in flavors for graph in graphs]
    reports = []
    if workers == 1:
        for job in jobs:
            reports.append(_export_one(cfg.to_dict(), options, *job))
            if progress:
                progress(reports[-1])
        return reports
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_export_one, cfg.to_dict(), options, *job) for job in jobs]
        for fut in as_completed(futures):
            reports.append(fut.result())
            if progress:
                progress(reports[-1])
    order = {job[2]: i for i, job in enumerate(jobs)}
    return sorted(reports, key=lambda r: order[str(r.path)])
