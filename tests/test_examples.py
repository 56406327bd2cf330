"""The two framework examples take the same flags, spelled and meant alike, and both run end to
end on a tiny model, a rerun reusing the KV store."""

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import write_docs

ROOT = Path(__file__).resolve().parents[1]
NAMES = ("llama_index_rag", "langchain_rag")
DOCS = {"a.md": "# Ships\n\nThe ship Marisol has a blue hull and sails from Velmora every morning.",
        "b.txt": "The bakery on Quay Street sells fennel bread. It opens at six."}


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}",
                                                  ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def examples():
    pytest.importorskip("llama_index.core")
    pytest.importorskip("langchain_core")
    return {name: load(name) for name in NAMES}


def test_the_examples_take_the_same_flags(examples):
    def flags(module) -> dict:
        return {a.dest: (tuple(a.option_strings), a.nargs, a.type, a.help, type(a).__name__)
                for a in module.arg_parser()._actions}

    llama, langchain = (flags(examples[name]) for name in NAMES)
    assert llama == langchain
    assert {"--docs", "--question", "--top-k", "--chunk-tokens", "--runs", "--model",
            "--max-new-tokens", "--kv-store"} <= {o for v in llama.values() for o in v[0]}
    defaults = [{a.dest: a.default for a in examples[name].arg_parser()._actions}
                for name in NAMES]
    # the answers' length alone differs: the LangChain example streams whole answers when timed
    assert {k for k in defaults[0] if defaults[0][k] != defaults[1][k]} == {"max_new_tokens"}


def test_the_examples_read_and_refuse_flags_alike(examples, tmp_path, capsys):
    first, second = write_docs(tmp_path / "one", DOCS), write_docs(tmp_path / "two", DOCS)
    for module in examples.values():
        args = module.parse_args(["--docs", str(first), str(second / "a.md"), "--question",
                                  "q1", "--question", "q2", "--kv-store", "kv"])
        assert args.docs == [first, second / "a.md"] and args.question == ["q1", "q2"]
        assert args.kv_store == Path("kv")
        assert module.parse_args([]).question == [module.DEFAULT_QUESTION]
        assert module.find_files([first, second / "a.md"]) == [
            first / "a.md", first / "b.txt", second / "a.md"]
        for argv, says in ((["--docs", str(tmp_path / "missing")], "no such file or folder"),
                           (["--chunk-tokens", "8"], "--chunk-tokens at least 16"),
                           (["--runs", "0"], "--runs"),
                           (["--store", "kv"], "unrecognized arguments"),
                           (["--max-tokens", "3"], "unrecognized arguments")):
            with pytest.raises(SystemExit) as exit:
                module.parse_args(argv)
            assert exit.value.code == 2 and says in capsys.readouterr().err, (module, argv)


@pytest.mark.parametrize("name", NAMES)
def test_each_example_runs_and_a_rerun_reuses_the_kv_store(examples, name, tmp_path, model_dir,
                                                           capsys):
    docs = write_docs(tmp_path / "docs", DOCS)
    kv = tmp_path / "kv"
    argv = ["--docs", str(docs), "--model", model_dir, "--kv-store", str(kv), "--top-k", "2",
            "--chunk-tokens", "256", "--runs", "1", "--max-new-tokens", "2",
            "--question", "Which ship has a blue hull?", "--question", "When does the bakery open?"]
    assert not examples[name].main(argv)
    out = capsys.readouterr().out
    assert out.count("Q: ") == 2 and out.count("sources:") == 2, out
    assert out.count("TTFT") >= 2 and "a.md" in out, out
    assert f"KV store {kv}" in out

    def blobs() -> dict:
        return {path: (path.stat().st_ino, path.stat().st_mtime_ns)
                for path in kv.rglob("*.safetensors")}

    before = blobs()
    assert before
    assert not examples[name].main(argv[:-2])
    assert blobs() == before  # no blob written again
