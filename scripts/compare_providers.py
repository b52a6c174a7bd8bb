#!/usr/bin/env python3
"""Find the first node where two ONNX Runtime providers disagree on a bundle graph: every node
output becomes a graph output, both providers run the same feeds (a fresh cache and a few ids),
and the nodes are listed in graph order with their largest difference. With every node output a
graph output, ONNX Runtime cannot reuse their buffers, so a fault of its memory reuse (2026-12-05:
onnxruntime-gpu 1.31.1's CUDA provider, which export/ort_session.py works around) does not show here.

    python scripts/compare_providers.py --bundle engines/tiny --graph decoder_step \
        [--provider CUDAExecutionProvider]
"""

from __future__ import annotations

import argparse
import logging

import numpy as np

log = logging.getLogger("compare_providers")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--graph", default="decoder_step")
    ap.add_argument("--provider", default="CUDAExecutionProvider")
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--show", type=int, default=12)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import onnx
    import onnxruntime as ort
    import torch

    from dsflash.export.bundle import Bundle
    from dsflash.model.cache import ModelCache

    bundle = Bundle.open(args.bundle)
    path = bundle.graph_path(args.graph, "portable")
    proto = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False))
    typed = {v.name: v for v in proto.graph.value_info}
    order = []
    for node in proto.graph.node:
        if node.op_type == "Constant":
            continue
        for out in node.output:
            if out in typed:
                proto.graph.output.append(typed[out])
                order.append((out, node.op_type, node.name))
    cache = ModelCache.allocate(bundle.config, 1, 64)
    feeds = {"ids": torch.tensor([[5, 9, 100, 7, 3]]), **cache.gather(cache.slot_index([0]))}
    names = [i.name for i in proto.graph.input]
    np_feeds = {n: feeds[n].numpy() for n in names}
    results = {}
    for prov in ("CPUExecutionProvider", args.provider):
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                      str(bundle.path.resolve()))
        opts.log_severity_level = 3
        p = (prov, {"use_tf32": "0"}) if prov == "CUDAExecutionProvider" else prov
        sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=[p])
        wanted = [o for o, _, _ in order]
        results[prov] = dict(zip(wanted, sess.run(wanted, np_feeds)))
    shown = 0
    for out, op, name in order:
        a, b = results["CPUExecutionProvider"][out], results[args.provider][out]
        if a.shape != b.shape:
            log.info("%-16s %-40s shape %s vs %s", op, name, a.shape, b.shape)
            shown += 1
        elif a.dtype.kind in "fc":
            fin = np.isfinite(a) & np.isfinite(b)
            diff = float(np.abs(a[fin] - b[fin]).max()) if fin.any() else 0.0
            scale = float(np.abs(a[fin]).max()) if fin.any() else 0.0
            if diff > args.rtol * max(scale, 1.0) or not np.array_equal(np.isfinite(a), np.isfinite(b)):
                log.info("%-16s %-40s max |diff| %.3g (scale %.3g)", op, name, diff, scale)
                shown += 1
        elif not np.array_equal(a, b):
            log.info("%-16s %-40s %d of %d elements differ", op, name, int((a != b).sum()), a.size)
            shown += 1
        if shown >= args.show:
            break
    if shown == 0:
        log.info("no node differs beyond rtol %g", args.rtol)


if __name__ == "__main__":
    main()
