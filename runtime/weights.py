"""Rebuild the reference model from a bundle: the graphs' initializers carry the parameters under
their checkpoint names (in weights.bin), so the torch backend serves exactly the exported model."""

from __future__ import annotations

import torch

from dsflash.export.bundle import Bundle
from dsflash.export.contract import GRAPHS
from dsflash.model.model import DSFlashModel


@torch.no_grad()
def model_from_bundle(bundle: Bundle) -> DSFlashModel:
    import onnx
    from onnx import numpy_helper

    model = DSFlashModel(bundle.config).eval()
    own = dict(model.named_parameters())
    loaded: set[str] = set()
    flavor = "portable" if "portable" in bundle.flavors else bundle.flavors[0]
    for graph in GRAPHS:
        proto = onnx.load(str(bundle.graph_path(graph, flavor)), load_external_data=False)
        onnx.external_data_helper.load_external_data_for_model(proto, str(bundle.path))
        for init in proto.graph.initializer:
            if init.name in own and init.name not in loaded:
                value = torch.from_numpy(numpy_helper.to_array(init).copy())
                if tuple(value.shape) != tuple(own[init.name].shape):
                    raise ValueError(f"bundle tensor {init.name} has shape {tuple(value.shape)}, the "
                                     f"model expects {tuple(own[init.name].shape)}")
                own[init.name].copy_(value)
                loaded.add(init.name)
    # Parameters no graph reads (e.g. the image-token router bias) cannot change any output.
    for name in set(own) - loaded:
        own[name].zero_()
    return model
