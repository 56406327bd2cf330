"""The package's import graph: no circle anywhere, and every import goes one way, down the
layers drawn in docs/concepts.md#architecture.

Imports are read from the source (function-local ones included: an import hidden in a function
still closes a circle at run time), so the test needs no model and runs in a second.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "turborag_integrations"

# Groups of modules, lowest first. A module may import its own group and the groups listed for
# it; siblings named on one line may not import each other.
CORE = f"{PACKAGE}.core"
GROUPS = {
    "foundation": [f"{CORE}.settings", f"{CORE}.errors", f"{CORE}.environment", f"{CORE}.tensorfile",
                   f"{CORE}.transformers_api"],
    "attention": [f"{CORE}.attention"],
    "kv": [f"{CORE}.kv"],
    "prefill": [f"{CORE}.prefill"],
    "decode": [f"{CORE}.decode"],
    "retrieval": [f"{CORE}.retrieval"],
    "model": [f"{CORE}.models", f"{CORE}.bundled", f"{CORE}.checkpoint"],
    "store": [f"{CORE}.store"],
    "engine": [f"{CORE}.engine", f"{CORE}.admission", f"{CORE}.assembly", f"{CORE}.planner", f"{CORE}.config", f"{CORE}.shared", f"{CORE}.library",
               f"{CORE}.request", f"{CORE}.run",
               f"{CORE}.registry", f"{CORE}.async_iter", f"{CORE}.batching", f"{CORE}.batch_worker",
               f"{CORE}.scheduled", f"{CORE}.prompt_template"],
    "rapid": [f"{CORE}.rapid"],
    "core": [CORE],  # core/__init__
    "llama_index": [f"{PACKAGE}.llama_index"],
    "langchain": [f"{PACKAGE}.langchain"],
    "workspace": [f"{PACKAGE}.workspace", f"{PACKAGE}.documents"],
    "evaluation": [f"{PACKAGE}.evaluation"],
    "training": [f"{PACKAGE}.training"],
    "server": [f"{PACKAGE}.server"],
    "vllm": [f"{PACKAGE}.vllm"],
    "app": [f"{PACKAGE}.cli", PACKAGE],
}
_CORE_BELOW_ENGINE = ["foundation", "attention", "kv", "prefill", "decode", "retrieval", "model",
                      "store"]
ALLOWED = {
    "foundation": [],
    "attention": ["foundation"],
    "kv": ["foundation"],
    "prefill": ["foundation", "attention", "kv"],
    "decode": ["foundation", "attention", "kv"],
    "retrieval": ["foundation"],
    "model": ["foundation", "kv", "prefill"],
    "store": ["foundation", "kv", "model"],
    "engine": _CORE_BELOW_ENGINE,
    "rapid": _CORE_BELOW_ENGINE + ["engine"],
    "core": ["foundation"],
    "llama_index": ["core", "engine", "rapid"] + _CORE_BELOW_ENGINE,
    "langchain": ["core", "engine", "rapid"] + _CORE_BELOW_ENGINE,
    "workspace": ["core", "engine", "rapid"] + _CORE_BELOW_ENGINE,
    "evaluation": ["core", "engine", "rapid"] + _CORE_BELOW_ENGINE,
    "training": ["core", "engine", "rapid", "evaluation", "llama_index", "langchain"]
                + _CORE_BELOW_ENGINE,
    "server": ["core", "engine", "rapid"] + _CORE_BELOW_ENGINE,
    "vllm": ["core", "engine"] + _CORE_BELOW_ENGINE,
    "app": list(GROUPS),
}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of the package that `name` imports, each with the parent packages Python
    initialises on the way (except the importer's own packages, which are already loading)."""
    base = name.split(".") if is_package(path) else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = base[:len(base) - node.level + 1]
                mod = ".".join(pkg + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for target in targets:
            if target.split(".")[0] != PACKAGE:
                continue
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                candidate = ".".join(parts[:i])
                if candidate in known and not name.startswith(candidate + ".") and candidate != name:
                    found.add(candidate)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def group_of(module: str) -> str:
    best, length = None, -1
    for group, prefixes in GROUPS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = group, len(prefix)
    assert best is not None, f"{module} belongs to no layer: add it to GROUPS"
    return best


def test_no_import_circle():
    edges = graph()
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    assert circles == []


def test_imports_go_down_the_layers():
    wrong = []
    for module, targets in graph().items():
        mine = group_of(module)
        for target in targets:
            theirs = group_of(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert wrong == []


def test_the_check_sees_a_circle():
    """The graph reader finds function-local and relative imports (so the tests above can
    fail)."""
    edges = graph()
    assert f"{CORE}.decode.sampling" in edges[f"{CORE}.decode.selfspec"]
    assert f"{CORE}.rapid.engine" in edges[f"{CORE}.rapid"]
    assert group_of(f"{CORE}.prefill.stitch") == "prefill"


def test_every_module_imports_on_its_own():
    """Each module imports in a fresh package state (no reliance on another module having been
    imported first)."""
    names = [n for n in modules() if not n.endswith("__main__")]
    if importlib.util.find_spec("vllm") is None:
        # the connector and its metrics run inside vLLM's own venv; tests/vllm imports them there
        names.remove(f"{PACKAGE}.vllm.connector")
        names.remove(f"{PACKAGE}.vllm.metrics")
    script = (
        "import importlib, sys, warnings\n"
        "warnings.simplefilter('ignore')\n"
        "failed = []\n"
        f"for name in {names!r}:\n"
        f"    for m in [m for m in sys.modules if m == {PACKAGE!r} or m.startswith({PACKAGE!r} + '.')]:\n"
        "        del sys.modules[m]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def _is_shim(path: Path) -> bool:
    """A module whose body is only imports (and `__all__`): a name kept alive for old callers."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    rest = [n for n in body if not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
            and not (isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets]
                     == ["__all__"])]
    return bool(rest) and all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in rest)


def test_no_compat_module_and_no_re_export_shims():
    """The package has one name for each module: no import hook serving old module paths, and
    no module that only re-exports another (packages' __init__ files gather their public API)."""
    package = ROOT / PACKAGE
    assert not list(package.rglob("compat.py"))
    shims = [str(p.relative_to(ROOT)) for p in package.rglob("*.py")
             if p.name != "__init__.py" and _is_shim(p)]
    assert shims == []
    proc = subprocess.run([sys.executable, "-c", f"import {CORE}.stitch"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert "ModuleNotFoundError" in proc.stderr


# Modules that may read os.environ: the one that reads every variable the package knows, and
# vLLM's launcher, which hands its environment on to the server it starts.
ENVIRONMENT_READERS = {f"{PACKAGE}/core/environment.py", f"{PACKAGE}/vllm/launch.py"}


def _reads_environment(path: Path) -> list[int]:
    """Lines where the module reads the process environment (os.environ, os.getenv)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ("environ", "getenv") for a in node.names):
            lines.append(node.lineno)
    return lines


def test_the_environment_is_read_in_one_place():
    """core/environment.py reads every variable; objects take settings as arguments."""
    readers = {str(p.relative_to(ROOT)): _reads_environment(p)
               for p in (ROOT / PACKAGE).rglob("*.py")}
    assert {p: lines for p, lines in readers.items()
            if lines and p not in ENVIRONMENT_READERS} == {}
    assert readers[f"{PACKAGE}/core/environment.py"]  # and the check sees a read


def test_every_data_file_the_package_reads_ships_in_the_wheel():
    """The evaluation sets, encoders and sample documents are read at run time from the
    installed package; a data file no package-data pattern names is missing from the wheel
    (data/longdoc once was, while `turborag eval` read it)."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["turborag_integrations"]
    package = root / "turborag_integrations"
    data = [p.relative_to(package).as_posix() for p in (package / "data").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts]
    assert data
    missing = [f for f in data if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not missing, f"data files no package-data pattern ships: {missing}"


# ---- how decisions travel: configurations and the request ----------------------------------
MAX_PARAMETERS = 8


def _functions():
    """(module path, qualified name, node) of every function and method of the package."""
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        stack = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.ClassDef):
                    stack.append((child, f"{prefix}{child.name}."))
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield str(path.relative_to(ROOT)), prefix + child.name, child


def _parameters(node) -> list[str]:
    """Named parameters, self/cls left out; `**settings` counts as one (the fields of a
    configuration dataclass, routed and checked there)."""
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return [n for n in names if n not in ("self", "cls")]


# Signatures another library defines, which the package implements as given.
FOREIGN_SIGNATURES = {
    f"{PACKAGE}/core/attention.py: attention_forward": "transformers' attention interface",
}


def _is_cli_command(path: str, node) -> bool:
    """A Typer command function (decorated, or registered as `app.command(...)(x_command)`):
    its parameters are the user's flags, and it only builds configurations from them."""
    return path.endswith("cli.py") and (node.name.endswith("_command") or any(
        isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "command"
        for d in node.decorator_list))


def test_no_public_function_takes_more_than_eight_parameters():
    """Settings travel as configurations (core/config.py, server/config.py, the RAPID and store
    configs), not as loose arguments: outside the CLI's command functions, no public function
    or constructor takes more than eight."""
    over = sorted(f"{path}: {name} ({len(_parameters(node))})"
                  for path, name, node in _functions()
                  if len(_parameters(node)) > MAX_PARAMETERS
                  and (not name.split(".")[-1].startswith("_") or name.endswith("__init__"))
                  and not _is_cli_command(path, node)
                  and f"{path}: {name}" not in FOREIGN_SIGNATURES)
    assert over == []


def test_the_parameter_check_sees_a_long_signature():
    node = ast.parse("def f(a, b, c, d, e, f, g, h, i): pass").body[0]
    assert len(_parameters(node)) == 9 > MAX_PARAMETERS


def _calls(name: str, first_arg: str | None = None) -> list[str]:
    """Where the package calls `name` (with `first_arg` as its first argument, if given)."""
    found = []
    for path, qualname, node in _functions():
        for call in ast.walk(node):
            if not isinstance(call, ast.Call):
                continue
            func = call.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called != name:
                continue
            if first_arg is not None and not (
                    call.args and isinstance(call.args[0], ast.Constant)
                    and call.args[0].value == first_arg):
                continue
            found.append(f"{path}: {qualname}")
    return sorted(set(found))


def test_a_request_is_checked_in_one_place():
    """The mode is checked where a request is made (core/request.py `Request`), and nowhere
    else: every surface (adapters, server, CLI) checks by making one."""
    assert _calls("check_choice", "mode") == [f"{PACKAGE}/core/request.py: Request.__post_init__"]


def test_a_recovery_spec_is_parsed_where_a_setting_is_made():
    """A recovery spec is parsed into a typed `Recovery` where a setting is made: an engine's
    default (`QueryConfig`), a request's (`Request`), and the vLLM connector's claim (no
    engine there). Every other surface checks a spec by making a Request and hands the parsed
    one on; the engine's low-level `prefill` takes only a parsed one."""
    assert _calls("parse_recovery") == [
        f"{PACKAGE}/core/config.py: QueryConfig.__post_init__",
        f"{PACKAGE}/core/request.py: Request.__post_init__",
        f"{PACKAGE}/vllm/claim.py: {_claim_parser()}",
    ]


def _claim_parser() -> str:
    (name,) = [q for p, q, n in _functions() if p.endswith("vllm/claim.py")
               and any(isinstance(c, ast.Call) and getattr(c.func, "id", None) == "parse_recovery"
                       for c in ast.walk(n))]
    return name


def test_no_core_module_is_over_400_lines():
    """A module that outgrows this holds more than one thing: split it where it divides."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / PACKAGE / "core").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_the_engine_shows_what_a_user_calls():
    """`TurboRAGEngine` has a chunk library and a prompt assembly (`engine.library`,
    `engine.assembly`) instead of being them: its own public methods are ingestion, answering
    and its lifecycle, ten at most."""
    from turborag_integrations.core.engine import TurboRAGEngine

    methods = sorted(name for name, value in vars(TurboRAGEngine).items()
                     if callable(value) and not name.startswith("_"))
    assert TurboRAGEngine.__mro__[1:] == (object,)
    assert methods == ["add_prompt", "close", "encode_chunks", "forget_document", "generate",
                       "namespaced", "prefill", "start", "stream", "warmup"]


def test_a_namespace_is_checked_where_it_is_opened():
    """Every path reaches a namespace's blobs through `KVStore.namespace(name)`, which checks
    the name; vLLM's ingestion requests check theirs as they are read, before any compute."""
    assert _calls("check_namespace") == [
        f"{PACKAGE}/core/store/kvstore.py: KVStore.namespace",
        f"{PACKAGE}/vllm/ingest.py: _where",
    ]
