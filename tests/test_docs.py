"""The documentation: the site builds strictly, and every quickstart code block runs as written."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path):
    if shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists():
        pytest.skip("mkdocs not installed (pip install -e '.[docs]')")
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).parent / "mkdocs")
    done = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def quickstart_blocks():
    text = (ROOT / "docs" / "index.md").read_text()
    return re.findall(r"```(bash|python)\n(.*?)```", text, flags=re.S)


@pytest.mark.real_model
def test_quickstart_code_blocks_run(tmp_path):
    blocks = quickstart_blocks()
    assert [lang for lang, _ in blocks].count("python") >= 1
    env = {**os.environ, "TURBORAG_WORKSPACE": str(tmp_path / "ws"),
           "TURBORAG_STORE": str(tmp_path / "kv")}
    for lang, code in blocks:
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{lang} block failed:\n{code}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        if lang == "python":
            assert "TTFT" in done.stdout and "came from the KV store" in done.stdout
