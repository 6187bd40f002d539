"""Each arrow points one way: no core module imports from a layer above its own.

The layers, lowest first, as the code stands (each imports only from those below
it, and from its own):

    errors < config < protocol < store < transport < control < peer < metrics < the rest

"The rest" is the engine integration (vllm/), the proxy and the operator apps
(cli, launch, demo, bench, chaos, ops), and the package root, which gathers the
public API. A lower layer that needs something of a higher one takes it as plain
data or through a hook the lower layer defines (`peer.thread.add_exporter`, which
ecshare.metrics fills), never by importing it. Every import counts: at module
level, under TYPE_CHECKING, and inside functions, where a loop hides best.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ecshare"
LAYERS = ("errors", "config", "protocol", "store", "transport", "control", "peer", "metrics")
# Anything not named in LAYERS (vllm, proxy, cli, bench, the root, ...) is above them all.
TOP = len(LAYERS)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def rank(module: str) -> int:
    """The layer of an ecshare module (`ecshare.peer.consumer` -> peer's)."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return TOP
    return LAYERS.index(parts[1])


def imported(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every ecshare import in the file, wherever it is written."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    text = path.read_text() if source is None else source
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ecshare"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != "ecshare":
                continue
            if target == "ecshare":
                # `from ecshare import protocol` names a module; `from ecshare import
                # Config` takes a name from the package root, the top layer.
                for alias in node.names:
                    sub = PACKAGE / alias.name
                    is_module = sub.is_dir() or sub.with_suffix(".py").exists()
                    out.append((node.lineno, f"ecshare.{alias.name}" if is_module else "ecshare"))
            else:
                out.append((node.lineno, target))
    return out


CORE = sorted(
    path for path in PACKAGE.rglob("*.py") if rank(module_name(path)) < LAYERS.index("metrics")
)


def test_the_core_modules_are_found() -> None:
    found = {module_name(path).split(".")[1] for path in CORE}
    assert found == set(LAYERS) - {"metrics"}


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_core_module_imports_nothing_above_its_layer(path: Path) -> None:
    own = rank(module_name(path))
    upward = [
        f"line {line}: {target} ({LAYERS[rank(target)] if rank(target) < TOP else 'the top'})"
        for line, target in imported(path)
        if rank(target) > own
    ]
    assert not upward, f"{module_name(path)} is in layer {LAYERS[own]} but imports " + "; ".join(
        upward
    )


def test_metrics_is_imported_by_no_core_module() -> None:
    """The loop this test was written for: peer/ served itself through ecshare.metrics."""
    importers = [
        module_name(path)
        for path in CORE
        if any(target.startswith("ecshare.metrics") for _, target in imported(path))
    ]
    assert importers == []


def test_an_upward_import_hidden_anywhere_is_caught() -> None:
    """The checker itself, on the shapes a loop hides in: a function body, a
    TYPE_CHECKING block, a relative import, and a name taken from the package root."""
    thread = PACKAGE / "peer" / "thread.py"
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from ecshare.metrics import Exposure\n"
        "def f():\n"
        "    from ..metrics import expose\n"
        "    import ecshare.vllm.connector\n"
        "    from ecshare import Config, store\n"
    )
    found = imported(thread, source)
    assert found == [
        (3, "ecshare.metrics"),
        (5, "ecshare.metrics"),
        (6, "ecshare.vllm.connector"),
        (7, "ecshare"),
        (7, "ecshare.store"),
    ]
    own = rank(module_name(thread))
    assert [target for _, target in found if rank(target) > own] == [
        "ecshare.metrics",
        "ecshare.metrics",
        "ecshare.vllm.connector",
        "ecshare",
    ]


def test_the_store_has_one_face_in_the_core() -> None:
    """Outside store/, the core goes through `Store`: it never imports the entry
    table, and never reaches it through `Store.table` (kept only for the engine
    integration and the apps until they move)."""
    found = []
    for path in CORE:
        if module_name(path).startswith("ecshare.store"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and any(a.name == "EntryTable" for a in node.names):
                found.append(f"{module_name(path)}:{node.lineno} imports EntryTable")
            elif isinstance(node, ast.Attribute) and node.attr == "table":
                found.append(f"{module_name(path)}:{node.lineno} uses .table")
    assert found == []
