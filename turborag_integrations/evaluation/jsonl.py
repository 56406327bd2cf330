"""Reading an evaluation set: one JSON object per line, malformed lines reported, not fatal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def read_jsonl(path: str | Path,
               parse: Callable[[dict, int], T]) -> tuple[list[T], list[tuple[int, str]]]:
    """`parse(object, line number)` of every non-blank line, and (line number, reason) for each
    line that is not a JSON object or that `parse` refuses with a ValueError or TypeError."""
    records, errors = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise ValueError("not a JSON object")
                records.append(parse(d, n))
            except (ValueError, TypeError) as exc:
                errors.append((n, str(exc) if not isinstance(exc, json.JSONDecodeError)
                               else f"invalid JSON: {exc.msg} (column {exc.colno})"))
    return records, errors
