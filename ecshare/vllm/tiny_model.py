"""A tiny random Qwen2-VL checkpoint, built offline in seconds, for tests and the demo.

    python -m ecshare.vllm.tiny_model DIR [--seed N] [--dtype float32|bfloat16]

writes everything vLLM needs to serve DIR as `Qwen2VLForConditionalGeneration`
without the hub: config, weights (safetensors), tokenizer, chat template and
image/video processor configs. Text: hidden 128, 2 layers, 4 heads / 2 KV
heads, vocab 270 (256 byte tokens and the 14 Qwen special tokens). Vision:
embed 64, depth 2, 2 heads, patch 14, merge 2, so one image token covers
28x28 pixels, and an image gets 4 to 64 tokens. Each encoder output row is
128 wide (the text hidden size).

The weights are random but seeded: the same seed and dtype give the same
bytes on every run, so the generated tokens are gibberish but reproducible.
The global torch RNG of the caller is left untouched.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Written last: a directory holding it with the same fields is a complete build.
MARKER = "ecshare-tiny-model.json"
# Bump when the checkpoint this module writes changes, so that cached builds are redone.
BUILD_VERSION = 1
DTYPES = ("float32", "bfloat16")
HIDDEN_SIZE = 128
# Large enough that greedy output varies with the image; with 0.08 it degenerates.
_INIT_STD = 0.15
_PIXELS_PER_TOKEN = 28 * 28
_MIN_IMAGE_TOKENS, _MAX_IMAGE_TOKENS = 4, 64

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# The chat template shipped with Qwen2-VL-*-Instruct.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_qwen2vl(
    directory: str | os.PathLike[str], *, seed: int = 0, dtype: str = "float32"
) -> Path:
    """Write the checkpoint into `directory` (replacing what is there) and return its path.

    The files are written to a sibling staging directory first and moved into
    place complete, so a reader never sees half a checkpoint.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    target = Path(directory).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
        token_ids = _write_checkpoint(staging, seed=seed, dtype=dtype)
        _marker_path(staging).write_text(
            json.dumps(_marker(seed, dtype, token_ids), indent=2, sort_keys=True) + "\n"
        )
        if is_built(target, seed=seed, dtype=dtype):
            return target  # another builder's, complete and maybe in use: as good as ours
        if target.exists():
            shutil.rmtree(target)
        try:
            staging.rename(target)
        except OSError:
            # Another builder got there first; its build is as good as ours.
            if not is_built(target, seed=seed, dtype=dtype):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ensure_tiny_qwen2vl(
    directory: str | os.PathLike[str], *, seed: int = 0, dtype: str = "float32"
) -> Path:
    """The checkpoint in `directory`, built first unless a matching build is there."""
    target = Path(directory).absolute()
    if is_built(target, seed=seed, dtype=dtype):
        return target
    return build_tiny_qwen2vl(target, seed=seed, dtype=dtype)


def is_built(directory: str | os.PathLike[str], *, seed: int = 0, dtype: str = "float32") -> bool:
    """Whether `directory` holds a complete build of this version, seed and dtype, made
    with the transformers installed here."""
    try:
        found = json.loads(_marker_path(Path(directory)).read_text())
    except (OSError, ValueError):
        return False
    want = _marker(seed, dtype, {})
    return isinstance(found, dict) and all(found.get(k) == v for k, v in want.items())


def token_ids(directory: str | os.PathLike[str]) -> dict[str, int]:
    """The special token ids of a build (`<|image_pad|>` is the image placeholder)."""
    found = json.loads(_marker_path(Path(directory)).read_text())
    return {str(k): int(v) for k, v in found["token_ids"].items()}


def _marker_path(directory: Path) -> Path:
    return directory / MARKER


def transformers_version() -> str:
    """The installed transformers' version, read from its metadata (nothing imported).
    A build is of one version: its files record it (config.json's `transformers_version`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "none"


def _marker(seed: int, dtype: str, ids: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "build_version": BUILD_VERSION,
        "seed": seed,
        "dtype": dtype,
        "transformers": transformers_version(),
    }
    if ids:
        out["token_ids"] = ids
    return out


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet in its token order: printable bytes as themselves, then
    the other bytes as chr(256 + n)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) for b in printable] + [chr(256 + n) for n in range(len(others))]


def _tokenizer() -> Any:
    from transformers import Qwen2Tokenizer

    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        # No unknown token: byte-level BPE covers every input. transformers
        # annotates str, but None is what it accepts for "none".
        unk_token=None,  # type: ignore[arg-type]
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _write_checkpoint(out: Path, *, seed: int, dtype: str) -> dict[str, int]:
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = _tokenizer()
    ids = {t: int(tok.convert_tokens_to_ids(t)) for t in SPECIAL_TOKENS}
    config = Qwen2VLConfig(
        text_config={
            # Exactly the tokenizer's size, so that every sampled id decodes.
            "vocab_size": len(tok),
            "hidden_size": HIDDEN_SIZE,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            # head_dim 32: the M-RoPE sections sum to head_dim / 2.
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": [4, 6, 6],
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "tie_word_embeddings": False,
        },
        vision_config={
            "depth": 2,
            "embed_dim": 64,
            "hidden_size": HIDDEN_SIZE,  # the merger's output feeds the text model
            "mlp_ratio": 2,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]

    # The constructor's own initialisation draws from the global RNG too, so
    # seed that, inside a fork that restores the caller's state afterwards.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, _INIT_STD)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)

    size = {
        "shortest_edge": _MIN_IMAGE_TOKENS * _PIXELS_PER_TOKEN,
        "longest_edge": _MAX_IMAGE_TOKENS * _PIXELS_PER_TOKEN,
    }
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            size=size,
            patch_size=14,
            temporal_patch_size=2,
            merge_size=2,
            image_mean=[0.48145466, 0.4578275, 0.40821073],
            image_std=[0.26862954, 0.26130258, 0.27577711],
        ),
        # Qwen2VLProcessor refuses to be built without a video processor.
        video_processor=Qwen2VLVideoProcessor(
            size=size, patch_size=14, temporal_patch_size=2, merge_size=2
        ),
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    generation = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return ids


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ecshare.vllm.tiny_model",
        description="Build a tiny random Qwen2-VL checkpoint offline.",
    )
    parser.add_argument("directory", help="where to write it (replaced if it exists)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="weight dtype")
    args = parser.parse_args(argv)
    path = build_tiny_qwen2vl(args.directory, seed=args.seed, dtype=args.dtype)
    print(json.dumps({"directory": str(path), "token_ids": token_ids(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
