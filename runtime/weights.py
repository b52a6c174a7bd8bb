"""Rebuild the reference model from a bundle: the graphs' initializers carry the parameters under
their checkpoint names (in weights.bin), so the torch backend serves exactly the exported model."""

from __future__ import annotations

import torch

from dsflash.export.bundle import Bundle
from dsflash.export.contract import GRAPHS
from dsflash.model.model import DSFlashModel
from dsflash.model.moe import routed_stacks


@torch.no_grad()
def model_from_bundle(bundle: Bundle) -> DSFlashModel:
    import onnx

    model = DSFlashModel(bundle.config).eval().to(bundle.dtype)
    own = dict(model.named_parameters())
    # the export holds each MoE's routed experts as stacks [E, ...] (model/moe.py export_form)
    stacks = routed_stacks(model)
    name_of = {id(p): name for name, p in own.items()}
    loaded: set[str] = set()
    flavor = "portable" if "portable" in bundle.flavors else bundle.flavors[0]
    for graph in GRAPHS:
        proto = onnx.load(str(bundle.graph_path(graph, flavor)), load_external_data=False)
        onnx.external_data_helper.load_external_data_for_model(proto, str(bundle.path))
        for init in proto.graph.initializer:
            if init.name in loaded or (init.name not in own and init.name not in stacks):
                continue
            value = _tensor(init)
            stacked = init.name in stacks
            targets = stacks[init.name] if stacked else [own[init.name]]
            want = (len(targets), *targets[0].shape) if stacked else tuple(targets[0].shape)
            if tuple(value.shape) != want:
                raise ValueError(f"bundle tensor {init.name} has shape {tuple(value.shape)}, the "
                                 f"model expects {want}")
            for target, row in zip(targets, value if stacked else [value]):
                target.copy_(row)
            loaded.add(init.name)
            loaded.update(name_of[id(t)] for t in targets)
    # Parameters no graph reads (e.g. the image-token router bias) cannot change any output.
    for name in set(own) - loaded:
        own[name].zero_()
    return model


def _tensor(init) -> torch.Tensor:
    """An initializer as a torch tensor; numpy has no bfloat16 (onnx hands ml_dtypes' type,
    which torch.from_numpy refuses), so bf16 goes over its 16-bit patterns."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    array = numpy_helper.to_array(init)
    if init.data_type == TensorProto.BFLOAT16:
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())
