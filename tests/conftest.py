from __future__ import annotations

import zlib

import pytest
import torch

from dsflash.model.config import ModelConfig
from dsflash.model.model import DSFlashModel


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return ModelConfig.preset("tiny")


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg) -> DSFlashModel:
    return DSFlashModel(tiny_cfg).init_weights(seed=1234).eval()


@pytest.fixture
def gen(request) -> torch.Generator:
    """Fresh random inputs per test, reproducible from the test's name."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def random_ids(gen: torch.Generator, batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=gen)


@pytest.fixture(scope="session")
def tiny_bundle(tiny_model, tmp_path_factory):
    """The tiny model exported once per test session, both flavors (about 3 minutes)."""
    from dsflash.export.bundle import write_bundle

    return write_bundle(tiny_model, tmp_path_factory.mktemp("bundle") / "tiny", "tiny",
                        ("plugin", "portable"), workers=2)
