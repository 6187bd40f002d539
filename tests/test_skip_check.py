"""tests/skip_check.py, run on a small suite of its own in a pytest of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SUITE = """
import pytest

def test_unlisted():
    pytest.skip("a tool this machine lacks")

def test_listed():
    pytest.skip("listed")

@pytest.mark.parametrize("n", [1, 2])
def test_listed_cases(n):
    pytest.skip("every case listed")

@pytest.mark.xfail(strict=True, reason="a known bug")
def test_known_bug():
    raise AssertionError

def test_passes():
    pass
"""


def _run(tmp_path: Path, allowed: str, ci: str) -> tuple[int, str]:
    (tmp_path / "test_suite.py").write_text(SUITE)
    (tmp_path / "test_missing.py").write_text('import pytest\npytest.importorskip("no_such_mod")\n')
    (tmp_path / "allowed.txt").write_text(allowed)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        "ECSHARE_SKIPS_ALLOWED": str(tmp_path / "allowed.txt"),
        "CI": ci,
        "ECSHARE_STRICT_SKIPS": "",
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "skip_check", "-p", "no:cacheprovider",
         "--continue-on-collection-errors", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


LISTED = (
    "# a comment\n"
    "test_suite.py::test_listed  the machine lacks it\n"
    "test_suite.py::test_listed_cases  no case can run here\n"
)


def test_ci_fails_a_skip_not_on_the_allow_list_and_keeps_those_on_it(tmp_path: Path) -> None:
    code, out = _run(tmp_path, LISTED, "true")
    assert code == 1, out
    assert "FAILED test_suite.py::test_unlisted" in out, out
    assert "not on the allow-list" in out and "a tool this machine lacks" in out, out
    assert "ERROR test_missing.py" in out, out  # a module skipped whole, not listed
    assert "SKIPPED [1] test_suite.py:8: listed" in out, out
    assert "SKIPPED [2] test_suite.py:12: every case listed" in out, out
    assert "XFAIL test_suite.py::test_known_bug" in out, out
    assert "PASSED test_suite.py::test_passes" in out, out
    assert out.count("SKIPPED") == 2, out
    assert "1 failed, 1 passed, 3 skipped, 1 xfailed, 1 error" in out, out


def test_without_ci_a_skip_is_a_skip(tmp_path: Path) -> None:
    code, out = _run(tmp_path, LISTED, "")
    assert code == 0, out
    assert "1 passed, 5 skipped, 1 xfailed" in out, out


def test_an_allowed_skip_must_say_why(tmp_path: Path) -> None:
    code, out = _run(tmp_path, "test_suite.py::test_listed\n", "true")
    assert code != 0 and "not said why" in out, out


def test_the_allow_list_names_tests_that_exist() -> None:
    from skip_check import ALLOWED, allowed

    repo = HERE.parent
    for nodeid in allowed(ALLOWED):
        path, _, name = nodeid.partition("::")
        assert (repo / path).is_file(), nodeid
        assert not name or f"def {name.split('[')[0]}(" in (repo / path).read_text(), nodeid
