"""`ecshare proxy` refuses, before it listens, every secret file its group or other users
may read: the API keys, the admin key, the tenant secret and its CURVE secret key for the
item feeds. Each is a real `ecshare proxy` process, one worker and two."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ecshare.control import KeyPair, generate_keypair
from ecshare.vllm.servers import free_port

pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")

ADMIN_KEY = "an-admin-key-of-some-length"


def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _secret_flags(tmp_path: Path, which: str) -> tuple[list[str], Path]:
    """The flags that give `ecshare proxy` the secret file `which`, and that file."""
    if which == "--events-key":
        files = generate_keypair(tmp_path, "proxy")
        flags = ["--events-port", str(free_port()), "--events-encoder-key"]
        flags += [KeyPair.generate().public_text, "--events-key", str(files.secret_path)]
        return flags, files.secret_path
    path = tmp_path / which.strip("-")
    path.write_text(
        {
            "--api-key-file": "key-of-team-a-0123 team-a\n",
            "--admin-key-file": ADMIN_KEY + "\n",
            "--tenant-secret-file": "a-tenant-secret-of-32-characters-or-more\n",
        }[which]
    )
    return [which, str(path)], path


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize(
    ("which", "mode", "who"),
    [
        ("--api-key-file", 0o644, "all users"),
        ("--admin-key-file", 0o640, "its group"),
        ("--tenant-secret-file", 0o640, "its group"),
        ("--events-key", 0o604, "all users"),
    ],
)
def test_ecshare_proxy_refuses_a_secret_file_others_may_read_and_never_listens(
    tmp_path: Path, which: str, mode: int, who: str, workers: str
) -> None:
    flags, path = _secret_flags(tmp_path, which)
    path.chmod(mode)
    port = free_port()
    cmd = [sys.executable, "-m", "ecshare", "proxy", "--pd", "http://127.0.0.1:9"]
    cmd += ["--port", str(port), "--workers", workers, *flags]
    env = {k: v for k, v in os.environ.items() if k != "ECSHARE_PROXY_API_KEY"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""  # no ready line: it never served
    assert f"{which}: '{path}' is accessible to {who} (mode {oct(mode)})" in proc.stderr
    assert f"Fix it with: chmod 600 {path}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not _listens(port)
