"""Every environment variable the package reads, read here and nowhere else.

Objects take their settings as arguments; the environment only changes the defaults those
arguments fall back to, so a deployment can point the package elsewhere without code. Each
function below reads one variable when it is called (not at import: tests and long-running
processes may change it), and an empty value counts as unset.

| variable | default of |
|---|---|
| `TURBORAG_CACHE` | where converted models and the default store live (`cache_dir()`) |
| `XDG_CACHE_HOME` | the parent of that folder when `TURBORAG_CACHE` is unset |
| `TURBORAG_STORE` | the KV store folder (`KVStore()` with no root) |
| `TURBORAG_REDIS_URL` | a Redis tier of `KVStore(remote_url=None)` |
| `TURBORAG_STORE_BYTES`, `TURBORAG_STORE_PREFIX_BYTES` | the disk tier's bounds |
| `TURBORAG_DECODE_MATMUL` | the fast decoder's products (`FastDecoder.for_model(matmul=None)`) |
| `TURBORAG_BATCH_MATMUL` | the batched decoder's products (`PackedLinears.for_decoder`) |
| `TURBORAG_WORKSPACE` | the CLI's workspace folder |
| `TURBORAG_VLLM_PYTHON` | the python of vLLM's venv (`turborag vllm`) |
| `OMP_WAIT_POLICY`, `GOMP_SPINCOUNT` | read, and `GOMP_SPINCOUNT` set when both are unset (`settle_openmp`) |

The command line's own variables are options of its commands, read by typer at the entry point
(cli.py: `TURBORAG_API_KEY` for `--api-key`, `TURBORAG_CHROMA_URL` for `--chroma-url`).
tests/test_architecture.py checks that no other module of the package reads `os.environ`, but
for vLLM's launcher, which hands its own environment on to the server it starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

STORE_DISK_BYTES = "TURBORAG_STORE_BYTES"
STORE_PREFIX_BYTES = "TURBORAG_STORE_PREFIX_BYTES"


# How long an OpenMP thread of torch's CPU build (GNU libgomp) spins at a barrier before it
# sleeps: libgomp's default is 300,000 iterations, and when another process holds one of the
# cores, the thread that waits spins through the time the descheduled one needed: a stitched
# prefill of 4K tokens on 2 shared cores took 2.2x its one-thread time, decode 2.1x. 1,000
# brings them to 1.1–1.25x and 1.0x under that load, and on a quiet machine stays within noise
# of the default (decode −12% in one run, +8% in another; benchmarks/shared_cores.py,
# docs/benchmarks.md); OMP_WAIT_POLICY=PASSIVE matches it under load but decodes 23–41% slower
# on a quiet machine.
OPENMP_SPINCOUNT = "1000"


def settle_openmp() -> bool:
    """Set `GOMP_SPINCOUNT` to `OPENMP_SPINCOUNT` when neither it nor `OMP_WAIT_POLICY` is set
    and torch is not loaded yet (OpenMP reads its environment once, as torch loads); True if it
    did. `import turborag_integrations` calls it first thing; a user who sets either variable,
    or loads torch before the package, keeps OpenMP's own choice."""
    if "torch" in sys.modules or _get("OMP_WAIT_POLICY") or _get("GOMP_SPINCOUNT"):
        return False
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT
    return True


def _get(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _path(name: str) -> Path | None:
    value = _get(name)
    return Path(value).expanduser() if value else None


def cache_dir() -> Path:
    """Where converted models (and, by default, the KV store) live: `TURBORAG_CACHE`, else
    `$XDG_CACHE_HOME/turborag`, else `~/.cache/turborag`."""
    explicit = _path("TURBORAG_CACHE")
    if explicit is not None:
        return explicit
    return (_path("XDG_CACHE_HOME") or Path.home() / ".cache") / "turborag"


def store_dir() -> Path:
    """The KV store's folder: `TURBORAG_STORE`, else `cache_dir()/kv`."""
    return _path("TURBORAG_STORE") or cache_dir() / "kv"


def redis_url() -> str | None:
    """`TURBORAG_REDIS_URL`: a Redis tier behind every store built without `remote_url`."""
    return _get("TURBORAG_REDIS_URL")


def size(name: str) -> str | None:
    """The text of a byte-size variable (`STORE_DISK_BYTES`, `STORE_PREFIX_BYTES`), unparsed."""
    return _get(name)


def decode_matmul() -> str:
    """`TURBORAG_DECODE_MATMUL`, default "auto"."""
    return _get("TURBORAG_DECODE_MATMUL") or "auto"


def batch_matmul() -> str:
    """`TURBORAG_BATCH_MATMUL`, default "auto"."""
    return _get("TURBORAG_BATCH_MATMUL") or "auto"


def workspace_dir() -> Path:
    """The CLI's workspace: `TURBORAG_WORKSPACE`, else `cache_dir()/workspace`."""
    return _path("TURBORAG_WORKSPACE") or cache_dir() / "workspace"


def vllm_python() -> Path | None:
    """`TURBORAG_VLLM_PYTHON`: the python of a venv with vLLM and this package."""
    return _path("TURBORAG_VLLM_PYTHON")


def bundled_file(folder: str, name: str | None) -> Path | None:
    """A file the package ships under `turborag_integrations/data/<folder>/` (a chunk
    encoder), or None when `name` is None or the file is not installed."""
    if name is None:
        return None
    from importlib import resources

    path = Path(str(resources.files("turborag_integrations") / "data" / folder / name))
    return path if path.exists() else None
