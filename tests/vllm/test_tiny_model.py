"""The tiny Qwen2-VL the vLLM tests and the demo serve: built offline, the same every time."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ecshare.vllm.tiny_model import (
    MARKER,
    build_tiny_qwen2vl,
    ensure_tiny_qwen2vl,
    is_built,
    token_ids,
    transformers_version,
)


def test_tiny_model_build_is_byte_identical_and_leaves_caller_rng_alone(
    tiny_model: Path, tmp_path: Path
) -> None:
    rng = torch.random.get_rng_state()
    again = build_tiny_qwen2vl(tmp_path / "again")
    assert torch.equal(torch.random.get_rng_state(), rng)

    files = sorted(p.name for p in tiny_model.iterdir())
    assert "model.safetensors" in files and "config.json" in files
    assert sorted(p.name for p in again.iterdir()) == files
    for name in files:
        assert (again / name).read_bytes() == (tiny_model / name).read_bytes(), name

    config = json.loads((again / "config.json").read_text())
    assert config["architectures"] == ["Qwen2VLForConditionalGeneration"]
    assert config["image_token_id"] == token_ids(again)["<|image_pad|>"]
    # A build of another seed is not this one, and ensure() leaves a match alone.
    assert is_built(again) and not is_built(again, seed=1)
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_qwen2vl(again) == again
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp
    # Nor is another transformers' build (its files record its version): ensure() redoes it.
    assert config["transformers_version"] == transformers_version()
    marker = json.loads((again / MARKER).read_text())
    (again / MARKER).write_text(json.dumps({**marker, "transformers": "4.0.0"}))
    assert not is_built(again)
    assert ensure_tiny_qwen2vl(again) == again and is_built(again)
    assert (again / "model.safetensors").stat().st_mtime_ns != stamp
