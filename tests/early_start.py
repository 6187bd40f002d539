"""Start a module's slow processes (real `vllm serve` instances, `ecshare launch`) before
the module's turn, where the run has a core to spare.

A vLLM start-up is tens of seconds of imports on one core per instance, while the tests
before a module's turn leave most of a second core idle (they wait on sockets, leases
and deadlines). A module defines `early_start = EarlyStart(name, instances, start)` at its top
level; tests/conftest.py calls `start()` once the instances of every earlier module that
serves vLLM are gone, and few enough started early live (see its docstring), and the
module's fixture calls `take()`. The processes start at niceness BACKGROUND_NICE, so
that they take only what CPU the tests running meanwhile leave, and are set back to the
session's own niceness (every descendant) when taken, so that the module's own tests see
them as if its fixture had started them; nothing about them differs otherwise. Each
runs in a session of its own, and the niceness is set on that session too
(`ecshare.vllm.servers.set_session_niceness`): where the kernel groups sessions, a
process's own niceness counts only within its session. Where nothing started them
early, `take()` starts them then.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import psutil
import pytest

from ecshare.vllm.servers import ensure_tiny_model, niceness, set_session_niceness
from ecshare.vllm.tiny_model import transformers_version

_T = TypeVar("_T")
# The tiny model the tests serve, one build per transformers version (its files record the
# version): `make test-vllm034` runs tests in this tree with another venv's.
TINY_MODEL_DIR = (
    Path(__file__).resolve().parents[1] / ".work" / f"tiny-qwen2vl-{transformers_version()}"
)
BACKGROUND_NICE = 19


class Process(Protocol):
    """What is started: a process (its descendants come with it) that can be stopped."""

    @property
    def proc(self) -> subprocess.Popen[Any] | None: ...

    def stop(self) -> Any: ...


@dataclass
class Starting(Generic[_T]):
    """What a module's start function made: its processes, started and maybe not yet
    ready, and whatever else its fixture needs (`value`)."""

    value: _T
    processes: Sequence[Process]


class EarlyStart(Generic[_T]):
    """A module's processes, started early by tests/conftest.py, taken by its fixture."""

    def __init__(
        self, name: str, instances: int, start: Callable[[Path, Path], Starting[_T]]
    ) -> None:
        self._name = name
        self.instances = instances  # of vLLM, for tests/conftest.py's bound on how many live
        self._start = start  # (a tmp folder of its own, the tiny model) -> Starting
        self._started: Starting[_T] | None = None
        self._taken = False

    def start(self, tmp_path_factory: pytest.TempPathFactory, nice: int = BACKGROUND_NICE) -> None:
        """Start the processes at niceness `nice`, unless they are started or were taken.
        Only a process that may lower a niceness again (root) starts them niced below its
        own priority; any other leaves them to `take()`."""
        below_own = nice > os.getpriority(os.PRIO_PROCESS, 0)
        if self._started is not None or self._taken or (below_own and os.geteuid() != 0):
            return
        model = ensure_tiny_model(TINY_MODEL_DIR)
        self._started = self._start(tmp_path_factory.mktemp(self._name), model)
        _renice(self._started.processes, nice)

    def take(self, tmp_path_factory: pytest.TempPathFactory) -> Starting[_T]:
        """The started processes, now the caller's to wait for and stop."""
        own = niceness()  # the session's: a run started niced stays so
        self.start(tmp_path_factory, nice=own)
        started, self._started, self._taken = self._started, None, True
        assert started is not None, f"{self._name}: taken twice"
        _renice(started.processes, own)
        return started

    def close(self) -> None:
        """Stop processes started early and never taken (their module did not run)."""
        started, self._started = self._started, None
        for process in started.processes if started is not None else ():
            process.stop()


def _renice(processes: Sequence[Process], nice: int) -> None:
    """Each process and every descendant it has started by now (later ones inherit), and
    each session they lead (never this session)."""
    ours = os.getsid(0)
    for process in processes:
        if process.proc is None:
            continue
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(process.proc.pid)
            for one in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error, OSError):
                    one.nice(nice)
                    if os.getsid(one.pid) != ours:
                        set_session_niceness(one.pid, nice)
