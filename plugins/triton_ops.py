"""torch.library ops `torch.ops.dsflash_triton.*` that run the Triton launchers, so that
torch.compile can trace a model on the kernels (`OpSet("triton")` under compilation) and fuse
the PyTorch ops around them, which stay opaque to it.

The eager Triton backend calls the launchers directly; a traced graph cannot hold a Python
launcher object, so under compilation `OpSet` calls these ops instead. Their fake
implementations come from the declarations (as for `torch.ops.dsflash.*`), and their
implementation is one set of launchers created at registration: the dispatcher is process-wide,
so every compiled model of the process shares those launchers' workspaces and must run its
kernels on one stream at a time (as any launcher requires).
"""

from __future__ import annotations

import torch

from dsflash.plugins.declaration import OpDecl
from dsflash.plugins.torch_ops import fake_outputs, is_registered

NAMESPACE = "dsflash_triton"


# Launchers that are not graph ops (no declaration): their schemas, and fakes with the launchers'
# output shapes and dtypes.
def _topk_fake(scores, k):
    # fp32 values and int64 indices of the min(k, N) best
    shape = (*scores.shape[:-1], min(k, scores.shape[-1]))
    return scores.new_empty(shape, dtype=torch.float32), scores.new_empty(shape, dtype=torch.int64)


def _pooled_score_fake(q, w, k, entries):
    return q.new_empty(entries.shape, dtype=torch.float32)  # fp32 scores of the listed slots


def _pooled_fp4_score_fake(q, w, codes, exps, entries):
    return q.new_empty(entries.shape, dtype=torch.float32)


LAUNCHER_OPS = {
    "stable_topk": ("(Tensor scores, int k) -> (Tensor, Tensor)", _topk_fake),
    "csa2_index_score_pooled": ("(Tensor q, Tensor w, Tensor k, Tensor entries) -> Tensor",
                                _pooled_score_fake),
    "csa2_index_score_fp4_pooled": (
        "(Tensor q, Tensor w, Tensor codes, Tensor exps, Tensor entries) -> Tensor", _pooled_fp4_score_fake),
}


def _register_decl(decl: OpDecl, launcher) -> None:
    qualname = f"{NAMESPACE}::{decl.torch_name}"
    torch.library.define(qualname, decl.schema())
    n_in = len(decl.inputs)
    names = [a.name for a in decl.attrs]

    def impl(*args):
        return launcher(*args[:n_in], **dict(zip(names, args[n_in:])))

    def fake(*args):
        return fake_outputs(decl, args[:n_in], dict(zip(names, args[n_in:])))

    torch.library.impl(qualname, "CompositeExplicitAutograd")(impl)
    torch.library.register_fake(qualname)(fake)


def _register_launcher(name: str, launcher) -> None:
    qualname = f"{NAMESPACE}::{name}"
    schema, fake = LAUNCHER_OPS[name]
    torch.library.define(qualname, schema)
    torch.library.impl(qualname, "CompositeExplicitAutograd")(launcher)
    torch.library.register_fake(qualname)(fake)


def register_triton_ops(decls: tuple[OpDecl, ...], launchers: dict) -> None:
    """Register `dsflash_triton::<torch_name>` for every declaration with a launcher in
    `launchers` (keyed by torch_name), and the launchers of LAUNCHER_OPS (the top-k, the listed
    pool's index scores); idempotent: the first registration's launchers serve the process."""
    for decl in decls:
        if decl.torch_name in launchers and not is_registered(NAMESPACE, decl.torch_name):
            _register_decl(decl, launchers[decl.torch_name])
    for name in LAUNCHER_OPS:
        if not is_registered(NAMESPACE, name):
            _register_launcher(name, launchers[name])
