"""The package's promises about its own shape."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

BLOCK_OPTIONAL = """
import sys
for name in ("torch", "nixl", "nixl_cu12", "vllm", "transformers", "aiohttp", "psutil", "rich",
             "matplotlib"):
    sys.modules[name] = None  # any import of these now raises ImportError
import ecshare, ecshare.peer, ecshare.store, ecshare.protocol, ecshare.config
import ecshare.control, ecshare.transport, ecshare.apps.cli
ecshare.apps.cli.build_parser()
from ecshare import Consumer, Producer, Store
print("ok")
"""


def test_core_and_command_line_import_without_optional_packages() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_OPTIONAL], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_command_without_its_optional_package_names_the_extra_to_install() -> None:
    # The chaos harness samples memory with psutil, which only its extra installs.
    code = (
        "import sys; sys.modules['psutil'] = None\n"
        "from ecshare.apps.cli import main\n"
        "sys.exit(main(['chaos', '--fetches', '1']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "needs the Python package 'psutil'" in out.stderr
    assert "pip install 'ecshare[chaos]'" in out.stderr
    assert "Traceback" not in out.stderr
    # The rest of the command line does not need it.
    code = (
        "import sys; sys.modules['psutil'] = None\n"
        "from ecshare.apps.cli import main\nmain(['--help'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "chaos" in out.stdout, out.stderr


def test_a_reader_that_went_away_is_no_crash() -> None:
    # `ecshare doctor --json | head -0`: the pipe's reader is gone before the report.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "ecshare", "doctor", "--json", "--no-selftest",
             "--region-bytes", str(64 << 20), "--no-prefault"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert "Traceback" not in out.stderr, out.stderr
    assert out.returncode == 128 + signal.SIGPIPE, out.stderr
