"""The config reference, generated from `Config`: rows, Markdown and the README section.

`describe_fields` lists every field with its type, default, what is allowed (including the
cross-field rules that name it) and its description; `render_reference_markdown` turns that
into the README's table; `update_readme_text` replaces the section between the
`config-reference` markers; and `main`, run as `python -m ecshare.config`, prints the section,
writes it into a README (`--write-readme`) or fails when one is stale (`--check`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ecshare.config.fields import _env_var, _Field, _flag, _render_default
from ecshare.config.schema import _RULES, _fields

README_START = "<!-- config-reference:start -->"
README_END = "<!-- config-reference:end -->"


class FieldDoc(NamedTuple):
    """One row of the config reference."""

    name: str
    type: str
    default: Any
    allowed: str
    description: str

    @property
    def env_var(self) -> str:
        return _env_var(self.name)

    @property
    def flag(self) -> str:
        return _flag(self.name)


def describe_fields() -> list[FieldDoc]:
    """Name, type, default, what is allowed and description of every field, in order."""
    return [
        FieldDoc(f.name, f.type_name, f.default, _allowed_with_rules(f), f.description)
        for f in _fields()
    ]


def _allowed_with_rules(field: _Field) -> str:
    allowed = field.constraints.allowed()
    rules = [r.expected for r in _RULES if r.key == field.name]
    return "; ".join([allowed, *rules])


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_reference_markdown() -> str:
    """The README's config reference, generated from `Config`."""
    lines = [
        "## Configuration reference",
        "",
        "Generated from `ecshare.config.Config` by `make config-doc`; do not edit by hand.",
        "",
        "Every key can be given in vLLM's `ec_connector_extra_config` (as the key), as an",
        "environment variable or as a command-line flag. Precedence, lowest first: defaults <",
        "environment < `ec_connector_extra_config` < command line. Environment and flag values",
        "are strings: booleans take `1/0/true/false/yes/no/on/off`, lists are comma-separated,",
        "and `none` or an empty string unsets an optional key. An unknown `ECSHARE_*` variable",
        "is an error. Sizes are in bytes and times in seconds.",
        "",
        "| Key | Env var | CLI flag | Type | Default | Allowed | Description |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    flags = {f.name: f for f in _fields()}
    for doc in describe_fields():
        field = flags[doc.name]
        flag = f"`{doc.flag}`"
        if field.constraints.kind is bool:
            flag = f"`{doc.flag}`, `--no-{doc.flag[2:]}`"
        cells = [
            f"`{doc.name}`",
            f"`{doc.env_var}`",
            flag,
            f"`{doc.type}`",
            _render_default(field),
            doc.allowed,
            doc.description,
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += ["", "Rules across keys, checked whenever a config is built:", ""]
    for rule in _RULES:
        why = f": {rule.why}" if rule.why else ""
        lines.append(f"- `{rule.key}` must be {rule.expected}{why}.")
    return "\n".join(lines) + "\n"


def update_readme_text(text: str) -> str:
    """`text` with the generated section between the markers (appended if they are absent)."""
    block = f"{README_START}\n{render_reference_markdown()}{README_END}"
    start = text.find(README_START)
    end = text.find(README_END, start + 1) if start >= 0 else -1
    if start >= 0 and end >= 0:
        return text[:start] + block + text[end + len(README_END) :]
    separator = (
        "" if not text or text.endswith("\n\n") else ("\n" if text.endswith("\n") else "\n\n")
    )
    return f"{text}{separator}{block}\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ecshare.config", description="Print or check the config reference."
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write-readme", metavar="PATH", type=Path, help="update PATH in place")
    action.add_argument("--check", metavar="PATH", type=Path, help="exit 1 if PATH is stale")
    args = parser.parse_args(argv)
    if args.write_readme is not None:
        path: Path = args.write_readme
        old = path.read_text(encoding="utf-8") if path.exists() else "# ecshare\n"
        new = update_readme_text(old)
        if new != old:
            path.write_text(new, encoding="utf-8")
        return 0
    if args.check is not None:
        text = args.check.read_text(encoding="utf-8") if args.check.exists() else ""
        if update_readme_text(text) != text:
            print(
                f"{args.check}: config reference is stale; run "
                f"`python -m ecshare.config --write-readme {args.check}`",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(render_reference_markdown())
    return 0
