from __future__ import annotations

import os
import zlib

import pytest
import torch

# Without CUDA the Triton kernels run in the interpreter; this must be set before they are
# imported (triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from interpreter_patching import install_builtin_name_cache

    install_builtin_name_cache()  # the interpreter's per-call builtin scan: a third of its time

from dsflash.model.config import ModelConfig  # noqa: E402
from dsflash.model.model import DSFlashModel  # noqa: E402


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
    """The tiny model exported once per test run, both flavors (about 3 minutes). Under
    pytest-xdist (CI runs two workers) the workers share one export in the run's temporary folder:
    the first to take the lock writes it, the others open it (its manifest is written last, so a
    bundle with one is whole). The tests only read it."""
    from filelock import FileLock

    from dsflash.export.bundle import Bundle, write_bundle

    shared = os.environ.get("PYTEST_XDIST_WORKER") is not None
    root = tmp_path_factory.getbasetemp().parent if shared else tmp_path_factory.mktemp("bundle")
    path = root / "tiny_bundle" / "tiny"
    with FileLock(str(root / "tiny_bundle.lock")):
        if (path / "manifest.json").is_file():
            return Bundle.open(path)
        return write_bundle(tiny_model, path, "tiny", ("plugin", "portable"), workers=2)


def submit_from_threads(loop, prompts: list, params) -> list:
    """Each prompt submitted to a ServingLoop from a thread of its own; -> the handles, in order,
    once every thread has submitted."""
    import threading

    handles = [None] * len(prompts)

    def client(i):
        handles[i] = loop.submit(prompts[i], params)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return handles


def run_script(name: str, *args: str, check: bool = True):
    """scripts/<name> run by this Python from the repository root; -> the CompletedProcess (text
    stdout / stderr)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, str(root / "scripts" / name), *args], capture_output=True,
                          text=True, check=check, cwd=root)


def check_two_sequences(bundle, model, flavor: str, gen: torch.Generator):
    """check_bundle over two prompts decoded together for 8 steps: one longer than the window
    (a replay prefill through encoder_prefill), one shorter; -> the report (11 steps)."""
    from dsflash.export.accuracy import check_bundle, reference_steps

    prompts = [random_ids(gen, 1, n, model.cfg.vocab_size)[0].tolist() for n in (19, 5)]
    return check_bundle(bundle, model, flavor, reference_steps(model, prompts, decode_steps=8))


def assert_export_option_refused(model, tmp_path, flavor: str, message: str, **option) -> None:
    """write_bundle and write_structures with a bad export option (decode_attention=...) raise a
    ValueError matching `message` before they create their output folders."""
    from dsflash.export.bundle import write_bundle
    from dsflash.export.structure import write_structures

    with pytest.raises(ValueError, match=message):
        write_bundle(model, tmp_path / "out", "x", (flavor,), **option)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=message):
        write_structures(model.cfg, tmp_path / "s", (flavor,), **option)
    assert not (tmp_path / "s").exists()
