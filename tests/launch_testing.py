"""`ecshare launch` as the end-to-end tests start it: its output read as it comes, its
ready line parsed, and the whole group stopped at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from ecshare.apps.ready import LaunchReady, parse_ready
from ecshare.vllm.servers import popen_session


@dataclass
class Launching:
    """`ecshare launch` started: its output as it comes (`lines`); `ready` is set at its
    ready line or when it exits."""

    proc: subprocess.Popen[str]
    lines: list[str]
    ready: threading.Event

    def info(self, timeout_s: float) -> LaunchReady:
        """Its ready line, once it came (within `timeout_s`); if it never did, the end of
        its output in the error."""
        self.ready.wait(timeout_s)
        for line in self.lines:
            found = parse_ready(line, LaunchReady)
            if found is not None:
                return found
        raise AssertionError("ecshare launch did not get ready:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> None:
        """SIGTERM, as a user's Ctrl-C; SIGKILL to its group (the instances too) after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_launch(workdir: Path, model: Path, *flags: str) -> Launching:
    """`ecshare launch --model model --workdir workdir` on a free port, a 64 MiB region,
    and `flags`; it runs in a session of its own, so that `stop` reaches its instances."""
    command = [
        sys.executable, "-m", "ecshare", "launch", "--model", str(model), "--port", "0",
        "--ec-extra-config", json.dumps({"region_bytes": 64 << 20}),
        "--workdir", str(workdir), *flags,
    ]  # fmt: skip
    proc = popen_session(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    launching = Launching(proc, [], threading.Event())

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            launching.lines.append(line.rstrip("\n"))
            if parse_ready(line, LaunchReady) is not None:
                launching.ready.set()
        launching.ready.set()  # it exited

    threading.Thread(target=read, daemon=True).start()
    return launching
