"""Weight initialisation (seeded, for test models) and safetensors I/O (never pickle).

Parameter names are the released checkpoint's (ARCHITECTURE.md Part B §1.2), so a state dict
saved here and a converted release shard load by exact key match.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic random weights that keep activations O(1) and routing/selection non-trivial.

    Linear weights ~ N(0, 1/fan_in); embeddings and Engram tables ~ N(0, 1); norm weights 1;
    mHC projections small (so coefficients stay near their sigmoid midpoints), sinks and router
    biases small random values so their code paths matter.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def normal_(p: torch.Tensor, std: float) -> None:
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight") or leaf in ("q_weight", "k_weight"):
            p.fill_(1.0)
        elif leaf.endswith("_fn"):
            normal_(p, 0.5 / p.shape[1] ** 0.5)
        elif leaf.endswith("_base") or leaf == "attn_sink" or leaf in ("bias", "bias_vl"):
            normal_(p, 0.1)
        elif leaf.endswith("_scale"):
            p.fill_(1.0)
        elif p.dim() == 2 and ("embed" in name):
            normal_(p, 1.0)
        elif p.dim() == 2:
            normal_(p, 1.0 / p.shape[1] ** 0.5)
        else:
            raise ValueError(f"no initialisation rule for parameter {name} of shape {tuple(p.shape)}")


def save_safetensors(model: nn.Module, path: str | Path) -> None:
    from safetensors.torch import save_file

    state = {k: _own_storage(v.detach().contiguous().cpu()) for k, v in model.state_dict().items()}
    save_file(state, str(path))


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """safetensors refuses tensors that share memory; the routed experts' weights are views of one
    stacked tensor per layer (model/moe.py), so those are copied out."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole else t.clone()


@torch.no_grad()
def load_safetensors(model: nn.Module, path: str | Path, strict: bool = True) -> None:
    """Load parameters by exact name; refuse missing / unexpected names and shape mismatches."""
    from safetensors.torch import load_file

    loaded = load_file(str(path))
    own = model.state_dict()
    missing = sorted(set(own) - set(loaded))
    unexpected = sorted(set(loaded) - set(own))
    if strict and (missing or unexpected):
        raise ValueError(f"checkpoint {path} does not match the model: missing {missing[:5]} "
                         f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)})")
    shared = [name for name in loaded if name in own]
    # every shape checked before the first copy: a refused checkpoint leaves the model as it was
    for name in shared:
        if tuple(loaded[name].shape) != tuple(own[name].shape):
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(loaded[name].shape)}, the "
                             f"model expects {tuple(own[name].shape)}")
    for name in shared:
        own[name].copy_(loaded[name].to(own[name].dtype))
    log.info("loaded %d tensors from %s", len(loaded), path)
