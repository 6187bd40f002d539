"""What `ecshare launch` checks before it starts anything, and the GPUs it finds.

Each check returns the problems it found, one line each, naming the flag to change, so that
launch can print them all and exit before any instance starts: a model path that does not
exist (or a hub name it cannot fetch while offline), a model vLLM serves as text only, an
instance config that does not
decode, a port that is taken or that two instances would share, an API-key file that
cannot be read or that its group or other users can read. Imports neither vllm nor torch.
"""

from __future__ import annotations

import ast
import errno
import functools
import importlib.util
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ecshare.apps.ops.network_checks import bind_error
from ecshare.config import ConfigError, load_config
from ecshare.config.secret_files import check_secret_file

# A Hugging Face hub id: NAME or ORG/NAME.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def find_gpus(environ: Mapping[str, str] | None = None, dev: Path = Path("/dev")) -> list[str]:
    """The NVIDIA GPUs instances may use: CUDA_VISIBLE_DEVICES where it is set (empty or
    -1 hides them all), else the /dev/nvidiaN device nodes."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [part.strip() for part in visible.split(",")]
        return [] if not ids or ids[0] in ("", "-1") else ids
    nodes = [p.name.removeprefix("nvidia") for p in dev.glob("nvidia[0-9]*")]
    return sorted((n for n in nodes if n.isdigit()), key=int)


def is_loopback(host: str) -> bool:
    return host in _LOOPBACK or host.startswith("127.")


def check_model(model: str, offline: bool) -> list[str]:
    """A local model must exist and hold a config.json (or be a .gguf file); a hub name is
    left to vLLM, unless the instances run offline and it is not in the local hub cache."""
    path = Path(model).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            return [f"--model {model}: {path} holds no config.json, so it is not a model"]
        if path.is_file() and path.suffix != ".gguf":
            return [f"--model {model}: {path} is a file, not a model directory or a .gguf file"]
        return []
    if not _HUB_ID.fullmatch(model):
        return [f"--model {model}: no such file or directory"]
    if offline and not _in_hub_cache(model):
        return [
            f"--model {model}: not a path on this host, and not in the Hugging Face cache, "
            "which the instances must use offline (HF_HUB_OFFLINE=1): download it first "
            "(huggingface-cli download), or pass its directory"
        ]
    return []


def check_multimodal(model: str) -> list[str]:
    """The model must be one vLLM serves as multimodal: ecshare shares the outputs of its
    encoders, and a text-only model has none (both instances would start, and the first
    request fail a minute later). Its `architectures` are read from its config.json and
    looked up in vLLM's model registry, read from its source without importing vllm.
    Where either cannot be read, or vLLM's registry names none of them (a model of its
    own code), nothing is said: vLLM will."""
    config = _config_json(model)
    if config is None:
        return []
    try:
        architectures = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return []
    multimodal, text_only = _vllm_registry()
    if any(a in multimodal for a in architectures):
        return []
    named = next((a for a in architectures if a in text_only), None)
    if named is None:
        return []
    return [
        f"--model {model}: vLLM serves {named} as a text-only model, and ecshare shares "
        "the outputs of a multimodal model's encoders (images, video, audio): pick a model "
        "that takes media, e.g. Qwen/Qwen2-VL-2B-Instruct"
    ]


def _config_json(model: str) -> Path | None:
    path = Path(model).expanduser()
    if path.is_dir():
        return path / "config.json" if (path / "config.json").is_file() else None
    if path.exists() or not _HUB_ID.fullmatch(model):
        return None  # a .gguf file, or nothing: check_model says
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    cached = try_to_load_from_cache(model, "config.json")
    return Path(cached) if isinstance(cached, str) else None


@functools.cache
def _vllm_registry() -> tuple[frozenset[str], frozenset[str]]:
    """The architectures vLLM's registry serves as multimodal, and as text generation
    only: the keys of its `_MULTIMODAL_MODELS` and `_TEXT_GENERATION_MODELS` (both empty
    where vllm or its registry cannot be read)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return frozenset(), frozenset()
    registry = Path(spec.origin).parent / "model_executor" / "models" / "registry.py"
    try:
        tree = ast.parse(registry.read_text())
    except (OSError, SyntaxError, ValueError):
        return frozenset(), frozenset()
    tables: dict[str, frozenset[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    keys = (k.value for k in node.value.keys if isinstance(k, ast.Constant))
                    tables[target.id] = frozenset(k for k in keys if isinstance(k, str))
    multimodal = tables.get("_MULTIMODAL_MODELS", frozenset())
    if not multimodal:
        return frozenset(), frozenset()  # a registry of another shape: say nothing
    return multimodal, tables.get("_TEXT_GENERATION_MODELS", frozenset())


def _in_hub_cache(model: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return True  # vLLM will say; nothing here can tell
    return isinstance(try_to_load_from_cache(model, "config.json"), str)


def check_api_key_file(path: str | None) -> list[str]:
    """The file exists, can be read, and only its owner may read it (the proxy's own check,
    `ecshare.config.secret_files`)."""
    if path is None:
        return []
    try:
        check_secret_file(path, "--api-key-file")
        with open(path, "rb"):
            pass
    except ConfigError as exc:
        return [str(exc)]
    except OSError as exc:
        return [f"--api-key-file: cannot read {path!r}: {exc.strerror or exc}"]
    return []


def check_configs(configs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Each instance's `ec_connector_extra_config` decodes (with the ECSHARE_* variables it
    inherits), as its connector will decode it; one line per distinct error."""
    problems: list[str] = []
    for extra in configs.values():
        try:
            load_config(extra=extra)
        except ConfigError as exc:
            where = exc.source if exc.source and exc.source.startswith("ECSHARE_") else None
            line = (
                f"{where}: {exc.detail}" if where else f"--ec-extra-config: {exc.key}: {exc.detail}"
            )
            if line not in problems:
                problems.append(line)
    return problems


def check_ports(fixed: Sequence[tuple[str, str, int, str]]) -> list[str]:
    """`fixed` holds (what, host, port, flag) of every port set in advance: none may be
    set twice, and each must be free to bind."""
    problems = []
    seen: dict[int, str] = {}
    for what, host, port, flag in fixed:
        if port == 0:
            continue
        if port in seen:
            problems.append(
                f"{flag}: port {port} is both {seen[port]}'s and {what}'s; "
                "leave it out (launch picks free ports) or give each its own"
            )
            continue
        seen[port] = what
        why = _bind_error(host, port)
        if why:
            problems.append(f"{flag}: {what} cannot listen on {host}:{port}: {why}")
    return problems


def _bind_error(host: str, port: int) -> str:
    exc = bind_error(host, port)
    if exc is None:
        return ""
    if exc.errno == errno.EADDRINUSE:
        return f"already in use (see: ss -ltnp 'sport = :{port}')"
    return exc.strerror or str(exc)
