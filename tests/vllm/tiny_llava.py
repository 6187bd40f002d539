"""A tiny random LLaVA checkpoint, built offline in seconds: a second architecture for the
end-to-end tests, unlike Qwen2-VL in every way that matters to ecshare.

    build_tiny_llava(DIR) -> DIR

writes what vLLM needs to serve DIR as `LlavaForConditionalGeneration` without the hub:
config, seeded random weights (safetensors), a byte-level tokenizer with `<image>`, a chat
template and a CLIP image processor. Every image is resized and cropped to 56x56 pixels,
16 patches of 14: a fixed 16 image tokens per image, whatever its size, and no
placeholder metadata (no grid, no M-RoPE). Vision: a 2-layer CLIP of width 64; text: a
2-layer Llama of width 128, rows of 128 per image token.

vLLM declares no placeholder metadata fields for LLaVA, so its items cannot go to
prefill/decode as metadata only: the proxy sends those instances the media, and they
take the embeddings from ecshare all the same (docs/VLLM.md).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

MARKER = "ecshare-tiny-llava.json"
BUILD_VERSION = 2
IMAGE_SIDE = 56
PATCH = 14
IMAGE_TOKENS = (IMAGE_SIDE // PATCH) ** 2
HIDDEN = 128
_INIT_STD = 0.15
SPECIAL = ("<s>", "</s>", "<pad>", "<image>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}USER: {% else %}ASSISTANT: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<image>\n{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] != 'user' %}</s>{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def build_tiny_llava(directory: str | os.PathLike[str], *, seed: int = 0) -> Path:
    """`directory` holding the checkpoint; built once (a marker file says so), atomically."""
    out = Path(directory)
    marker = out / MARKER
    wanted = {"build": BUILD_VERSION, "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()) == wanted:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        _write(staging, seed)
        (staging / MARKER).write_text(json.dumps(wanted))
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _tokenizer() -> Any:
    from transformers import Qwen2Tokenizer

    from ecshare.vllm.tiny_model import _byte_alphabet

    tok = Qwen2Tokenizer(
        vocab={ch: i for i, ch in enumerate(_byte_alphabet())},
        merges=[],
        unk_token=None,  # type: ignore[arg-type]
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        errors="replace",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _write(out: Path, seed: int) -> None:
    import torch
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tok = _tokenizer()
    ids = {t: int(tok.convert_tokens_to_ids(t)) for t in SPECIAL}
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE_SIDE,
            patch_size=PATCH,
            projection_dim=64,
        ),
        text_config=LlamaConfig(
            vocab_size=len(tok),
            hidden_size=HIDDEN,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            bos_token_id=ids["<s>"],
            eos_token_id=ids["</s>"],
            pad_token_id=ids["<pad>"],
            tie_word_embeddings=False,
        ),
        image_token_index=ids["<image>"],
        vision_feature_select_strategy="default",  # the CLS row dropped: 16 rows
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlavaForConditionalGeneration(config)
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() >= 2:
                    param.normal_(0.0, _INIT_STD)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    _original_layout(out / "model.safetensors")
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIDE},
            crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE},
        ),
        tokenizer=tok,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)
    tok.save_pretrained(out)
    generation = {
        "bos_token_id": ids["<s>"],
        "eos_token_id": ids["</s>"],
        "pad_token_id": ids["<pad>"],
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _original_layout(path: Path) -> None:
    """The vision tower's weights under `vision_tower.vision_model.`, as the LLaVA
    checkpoints vLLM's loader reads (transformers 5 saves them one level up)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    renamed = {
        f"vision_tower.vision_model.{k.removeprefix('vision_tower.')}"
        if k.startswith("vision_tower.") and not k.startswith("vision_tower.vision_model.")
        else k: v
        for k, v in tensors.items()
    }
    save_file(renamed, path, metadata={"format": "pt"})
