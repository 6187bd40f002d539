"""Every test docs/SECURITY.md names as the proof of a claim exists.

A claim whose test was renamed or removed would read as proven and no longer be: each
`path.py::test_name` (and each `::test_name` after it, of the same file) and each bare
test file the threat model names must be found under tests/.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# `proxy/test_a.py::test_b` or `proxy/test_a.py` or `::test_c`, as written in the doc.
NAMED = re.compile(r"`((?:[\w/]+/)?test_\w+\.py)?(?:::(test_\w+))?(?:\[[^\]`]*\])?`")


def named_tests(text: str) -> list[tuple[str, str | None]]:
    """(file under tests/, test or None) for each test the text names, in order."""
    found: list[tuple[str, str | None]] = []
    current: str | None = None
    for match in NAMED.finditer(text):
        path, test = match.group(1), match.group(2)
        if path is None and test is None:
            continue
        if path is not None:
            current = path
        if current is None:
            raise AssertionError(f"{match.group(0)} names a test before any file")
        found.append((current, test))
    return found


def resolve(path: str) -> Path | None:
    """The test file a name in the doc means: under tests/ (with or without that prefix),
    or, for a bare file name in a section about one folder, the one file of that name."""
    relative = path.removeprefix("tests/")
    if "/" in relative:
        file = ROOT / "tests" / relative
        return file if file.is_file() else None
    found = sorted((ROOT / "tests").rglob(relative))
    return found[0] if len(found) == 1 else None


def test_every_test_the_threat_model_names_exists() -> None:
    text = (ROOT / "docs" / "SECURITY.md").read_text()
    named = named_tests(text)
    assert len(named) > 40  # the threat table's rows and the sections below
    missing = []
    for path, test in named:
        file = resolve(path)
        if file is None:
            missing.append(path)
        elif test is not None and not re.search(rf"def {test}\b", file.read_text()):
            missing.append(f"{path}::{test}")
    assert not missing, f"docs/SECURITY.md names tests that do not exist: {missing}"


def test_a_name_after_a_file_belongs_to_that_file() -> None:
    text = "`proxy/test_a.py::test_b`, `::test_c`; `security/test_d.py`"
    assert named_tests(text) == [
        ("proxy/test_a.py", "test_b"),
        ("proxy/test_a.py", "test_c"),
        ("security/test_d.py", None),
    ]
