"""docs/TROUBLESHOOTING.md quotes only messages the code still prints.

Each quoted message (a ``> ``…`` `` line) must occur in a string of the source: a string
literal, an f-string or a %-format, with every ``{…}`` of the doc matching any value the
code fills in. Implicit concatenation of literals counts as one string, as Python sees it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from ecshare.peer import FailureReason

REPO = Path(__file__).parents[2]
DOC = REPO / "docs" / "TROUBLESHOOTING.md"
SOURCES = [*sorted((REPO / "ecshare").rglob("*.py")), *sorted((REPO / "scripts").rglob("*.py"))]
HOLE = "\x00"  # one run-time value, in the doc and in the source alike
QUOTE = re.compile(r"^> ``(.+)``$")


def _texts(tree: ast.AST) -> list[str]:
    """Every string of `tree`, with each run-time value as HOLE."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            parts = [v.value if isinstance(v, ast.Constant) else HOLE for v in node.values]
            out.append("".join(str(p) for p in parts))
    return [re.sub(r"%[-#0-9.]*[sdrfx]", HOLE, t) for t in out]


def _source_texts() -> list[str]:
    texts: list[str] = []
    for path in SOURCES:
        texts += _texts(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return texts


def _quoted() -> list[str]:
    lines = DOC.read_text(encoding="utf-8").splitlines()
    return [m.group(1) for line in lines if (m := QUOTE.match(line))]


def _pattern(quoted: str) -> re.Pattern[str]:
    """The doc's message as a regex: literal text, each {…} one run-time value or more."""
    pieces = re.split(r"\{[^{}]*\}", quoted)
    return re.compile(f"(?:{HOLE}|.)+?".join(re.escape(p) for p in pieces), re.DOTALL)


def _occurs(quoted: str, texts: list[str]) -> bool:
    """Whether `quoted` matches one of `texts`; only the texts that hold its longest
    literal piece are searched (the pattern's lazy holes are slow on the others)."""
    piece = max(re.split(r"\{[^{}]*\}", quoted), key=len)
    pattern = _pattern(quoted)
    return any(pattern.search(t) for t in texts if piece in t)


def test_every_quoted_message_occurs_in_the_source() -> None:
    quoted = _quoted()
    assert len(quoted) >= 30, "the doc's quotes are no longer found: check the > ``…`` format"
    texts = _source_texts()
    missing = [q for q in quoted if not _occurs(q, texts)]
    assert not missing, f"quoted in TROUBLESHOOTING.md but no longer in the source: {missing}"


def test_a_changed_message_would_be_caught() -> None:
    texts = _source_texts()
    real = "no {role} instance could be reached (tried {urls})"
    assert _occurs(real, texts)
    changed = "no {role} instance was reached (tried {urls})"
    assert not _occurs(changed, texts)
    # A message whose longest piece occurs, but not the whole of it, is not found.
    assert not _occurs("no {role} instance could be reached (tried {urls}) at all", texts)


def test_every_fetch_failure_reason_is_explained() -> None:
    text = DOC.read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.MULTILINE))
    assert rows == {reason.value for reason in FailureReason}
