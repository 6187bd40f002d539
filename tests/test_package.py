"""The package's promises about its own shape."""

from __future__ import annotations

import subprocess
import sys

BLOCK_OPTIONAL = """
import sys
for name in ("torch", "nixl", "nixl_cu12", "vllm", "transformers", "aiohttp"):
    sys.modules[name] = None  # any import of these now raises ImportError
import ecshare, ecshare.peer, ecshare.store, ecshare.protocol, ecshare.config
import ecshare.control, ecshare.transport, ecshare.cli
from ecshare import Consumer, Producer, Store
print("ok")
"""


def test_core_imports_without_torch_nixl_or_vllm() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_OPTIONAL], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
