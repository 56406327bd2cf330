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


def _cli_mentions() -> list[tuple[str, tuple[str, ...], tuple[str, ...]]]:
    """(where, command path, flags) of every `turborag VERB [SUB] --flag ...` the README and the
    docs show, read up to a backtick, a table bar or a comment."""
    import re
    import shlex

    groups = {"store": ("stats", "verify", "gc", "plan"), "keys": ("add", "list", "revoke"),
              "models": ("list", "prepare")}
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for match in re.finditer(r"(?<![\w/-])turborag ([a-z][^`|#\n]*)", line):
                try:
                    words = shlex.split(match.group(1))
                except ValueError:  # an unclosed quote in prose
                    words = match.group(1).split()
                if not words or not words[0].isalpha():
                    continue
                command = words[:1]
                if words[0] in groups and len(words) > 1 and words[1] in groups[words[0]]:
                    command = words[:2]
                flags = tuple(w.split("=")[0].rstrip(",.;:)") for w in words[len(command):]
                              if w.startswith("--") and len(w) > 2)
                found.append((f"{path.name}:{n}", tuple(command), flags))
    return found


def test_every_command_and_flag_the_docs_show_exists():
    """What the README and the docs tell a user to type is what the CLI takes: each command
    exists, and each flag shown with it is in its --help."""
    from typer.testing import CliRunner

    from turborag_integrations.cli import app

    mentions = _cli_mentions()
    assert len(mentions) > 20  # the check reads the docs at all
    runner, helps, wrong = CliRunner(), {}, []
    for where, command, flags in mentions:
        if command not in helps:
            result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "250"})
            helps[command] = result.output if result.exit_code == 0 else None
        if helps[command] is None:
            wrong.append(f"{where}: `turborag {' '.join(command)}` is not a command")
            continue
        # a whole option name: --store is not found inside --kv-store
        wrong += [f"{where}: `turborag {' '.join(command)}` has no {flag}" for flag in flags
                  if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps[command])]
    assert wrong == []


def test_every_kept_benchmark_result_is_cited():
    """benchmarks/results holds what a page, a script or a test names (a file's name, or a glob
    such as `results/ttft_select_*.json`): a result nobody cites is a variant measured and not
    chosen, and git's history keeps it."""
    cited = ""
    for folder in ("docs", "benchmarks", "tests", "turborag_integrations", "examples"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".md", ".py") and "results" not in path.parts:
                cited += path.read_text()
    cited += (ROOT / "README.md").read_text()
    globs = re.findall(r"results/([\w.*-]+)", cited)
    uncited = []
    for path in sorted((ROOT / "benchmarks" / "results").iterdir()):
        stem = path.name.rsplit(".", 1)[0]
        if stem in cited or any(Path(path.name).match(g) or Path(path.name).match(g + "*")
                                for g in globs):
            continue
        uncited.append(path.name)
    assert uncited == []
