"""The package list in pyproject.toml covers every package folder (PIPELINE.md §1)."""

import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_package_list_covers_every_package_folder():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared, dirs = set(cfg["packages"]), cfg["package-dir"]
    assert set(dirs) <= declared
    found = set()
    for top, pkg in {v: k for k, v in dirs.items() if k.count(".") <= 1}.items():
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    assert found == declared, f"undeclared: {found - declared}, missing: {declared - found}"


def test_model_imports_with_torch_only():
    code = ("import sys, dsflash.model.model, dsflash.model.generate; "
            "bad = [m for m in ('triton', 'onnx', 'onnxruntime', 'tensorrt') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
