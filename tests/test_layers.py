"""Each arrow points one way: no module imports from a layer above its own.

The layers, lowest first (each imports only from those below it, and from its own):

    errors < counts < config < protocol < store < transport < control < peer < metrics
        < vllm (the engine integration) < apps (the operator apps)

The package root gathers the public API from the core. The apps (cli, launch, demo,
epd_demo, ready, proxy, bench, chaos, ops) sit in ecshare.apps, and nothing outside it
imports them but ecshare.__main__. A lower layer that needs something of a higher one
takes it as plain data or through a hook the lower layer defines
(`peer.thread.add_exporter`, which ecshare.metrics fills), never by importing it. Every
import counts: at module level, under TYPE_CHECKING, and inside functions, where a loop
hides best. Each package's docstring says what it may import, and is held to it here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ecshare.store import Store

PACKAGE = Path(__file__).resolve().parents[1] / "ecshare"
CORE_LAYERS = (
    "errors",
    "counts",
    "config",
    "protocol",
    "store",
    "transport",
    "control",
    "peer",
    "metrics",
)
LAYERS = (*CORE_LAYERS, "vllm", "apps")
# The package root (and its __main__) gathers from every layer: above them all.
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
            # `from ecshare.apps.bench import fetch` names a module; `from ecshare import
            # Config` takes a name from the package (for the root: the top layer).
            folder = PACKAGE.parent.joinpath(*target.split("."))
            for alias in node.names if folder.is_dir() else ():
                sub = folder / alias.name
                is_module = sub.is_dir() or sub.with_suffix(".py").exists()
                out.append((node.lineno, f"{target}.{alias.name}" if is_module else target))
            if not folder.is_dir():
                out.append((node.lineno, target))
    return out


CORE = sorted(
    path for path in PACKAGE.rglob("*.py") if rank(module_name(path)) < LAYERS.index("metrics")
)
# Every module of a layer: the core's, the engine integration's and the apps'.
LAYERED = sorted(path for path in PACKAGE.rglob("*.py") if rank(module_name(path)) < TOP)


def test_the_layers_modules_are_found() -> None:
    found = {module_name(path).split(".")[1] for path in LAYERED}
    assert found == set(LAYERS)


def test_only_core_packages_and_the_root_sit_beside_the_layers() -> None:
    """The top of the tree shows the layers: no app module left beside the core."""
    top = {
        path.stem if path.is_file() else path.name
        for path in PACKAGE.iterdir()
        if (path.suffix == ".py" or (path / "__init__.py").exists())
    }
    assert top == {*LAYERS, "__init__", "__main__"}


@pytest.mark.parametrize("path", LAYERED, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_imports_nothing_above_its_layer(path: Path) -> None:
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


def test_the_store_has_one_face() -> None:
    """Outside store/, everything goes through `Store`: no module of the package
    imports the entry table, and `Store` hands it to nobody."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if module_name(path).startswith("ecshare.store"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and any(a.name == "EntryTable" for a in node.names):
                found.append(f"{module_name(path)}:{node.lineno} imports EntryTable")
        found += [
            f"{module_name(path)}:{line} imports {target}"
            for line, target in imported(path)
            if target == "ecshare.store.entries"
        ]
    assert found == []
    # The way round its methods that callers once had (`Store.table`) is gone.
    assert not [name for name in vars(Store) if "table" in name.lower() and name[0] != "_"]


def _package_imports(package: Path) -> set[str]:
    """The ecshare packages (or top modules) that the package's modules import, but its own."""
    own = module_name(package / "__init__.py")
    out = set()
    for path in package.rglob("*.py"):
        for _, target in imported(path):
            parts = target.split(".")
            name = ".".join(parts[:3] if parts[1:2] == ["apps"] and len(parts) > 2 else parts[:2])
            if not (name == own or name.startswith(own + ".") or own.startswith(name + ".")):
                out.add(name)
    return out


PACKAGES = sorted(init.parent for init in PACKAGE.rglob("__init__.py") if init.parent != PACKAGE)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_package_docstring_says_what_it_may_import_and_is_true(package: Path) -> None:
    """`May import: ...` in each package's docstring names no more than its layer
    allows and no less than it imports; "anything in ecshare" only for the apps."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    said = " ".join(doc.split()).partition("May import: ")[2]
    assert said, f"{package.relative_to(PACKAGE)}'s docstring has no 'May import:' line"
    own = rank(module_name(package / "__init__.py"))
    if said.startswith("anything in ecshare"):
        assert LAYERS[own] == "apps"
        return
    named = set(re.findall(r"ecshare(?:\.[a-z_]+)+", said.partition(", never")[0]))
    assert all(rank(name) < own for name in named), named
    assert _package_imports(package) <= named


def _graph() -> dict[str, set[str]]:
    """Every module of the package (a package as its __init__) and the modules it
    imports, wherever in the file; a name taken from a module is an arrow to it."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for _, target in imported(path):
            # `from ecshare.peer.consumer import Consumer` -> ecshare.peer.consumer.
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target != name:
                targets.add(target)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph`: each strongly connected part of more than one
    module (Tarjan's algorithm), its modules sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(out)


def test_no_import_circle_anywhere_in_the_package() -> None:
    """Not only between layers: inside one (the apps' bench and proxy once had two), and
    through a package's __init__, an import made anywhere in a file closes no circle."""
    assert circles(_graph()) == []


def test_the_circle_finder_finds_a_circle_through_a_lazy_import() -> None:
    graph = _graph()
    # bench/report once imported the benches for their result types, and each bench
    # imported report inside its run function to print its result.
    graph["ecshare.apps.bench.fetch"].add("ecshare.apps.bench.report")
    found = circles(graph)
    assert any({"ecshare.apps.bench.fetch", "ecshare.apps.bench.report"} <= set(c) for c in found)
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
