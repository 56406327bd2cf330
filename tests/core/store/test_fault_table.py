"""The fault table of docs/kv_store.md names, for every fault, tests that exist."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def fault_rows() -> list[str]:
    text = (ROOT / "docs" / "kv_store.md").read_text()
    section = text.split("\n## Faults\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ")][1:]  # no header


def test_every_fault_names_tests_that_exist():
    rows = fault_rows()
    assert len(rows) >= 9
    for row in rows:
        named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row.split(" | ")[-1])
        assert named, f"no test named for the fault {row.split(' | ')[0]!r}"
        for path, test in named:
            source = ROOT / path
            assert source.exists(), f"{path} does not exist"
            assert re.search(rf"^def {test}\(", source.read_text(), flags=re.M), \
                f"{path} has no test {test}"
