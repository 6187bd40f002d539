"""Inline media is bounded by what it decodes to, read from its header (`bounds`).

Each test crafts real media (Pillow images, OpenCV videos, stdlib WAVs) and checks it the
way the proxy does before any encoder call; the bounds are the configured defaults where
the media is small enough to make, else small bounds around small media.
"""

from __future__ import annotations

import ast
import base64
import importlib.util
import io
import wave
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest
from PIL import Image

from ecshare.apps.proxy.bounds import IMAGE_FORMATS, MediaBounds, check_media
from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.errors import ProxyError

DEFAULTS = MediaBounds.of(ProxyConfig(prefill_decode=("http://127.0.0.1:1",)))


def bounds(pixels: int = 1 << 30, frames: int = 1 << 30, seconds: float = 1e9) -> MediaBounds:
    return MediaBounds(max_image_pixels=pixels, max_video_frames=frames, max_audio_seconds=seconds)


def data_url(data: bytes, media_type: str) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat(*parts: dict[str, Any]) -> dict[str, Any]:
    content = [*parts, {"type": "text", "text": "describe"}]
    return {"model": "m", "messages": [{"role": "user", "content": content}]}


def image_part(data: bytes, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_url(data, media_type)}}


def image(size: tuple[int, int], fmt: str = "PNG", mode: str = "L") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size).save(out, fmt)
    return out.getvalue()


def video(path: Path, size: tuple[int, int], frames: int) -> bytes:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter.fourcc(*"mp4v"), 10, size)
    assert writer.isOpened()
    black = np.zeros((size[1], size[0], 3), np.uint8)
    for _ in range(frames):
        writer.write(black)
    writer.release()
    return path.read_bytes()


def wav(seconds: float, rate: int = 8000, claimed: float | None = None) -> bytes:
    """A WAV of `seconds` of silence (8-bit mono); its header claims `claimed` seconds."""
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(1)
        writer.setframerate(rate)
        writer.writeframes(bytes(int(seconds * rate)))
    data = bytearray(out.getvalue())
    if claimed is not None:  # the data chunk's size, at byte 40 of a plain 44-byte header
        data[40:44] = int(claimed * rate).to_bytes(4, "little")
    return bytes(data)


def refused(body: dict[str, Any], limits: MediaBounds, reason: str) -> str:
    with pytest.raises(ProxyError) as caught:
        check_media(body, limits)
    assert (caught.value.status, caught.value.reason) == (400, reason)
    return caught.value.message


# -- images ----------------------------------------------------------------------------------


def test_a_small_png_that_decodes_to_64_megapixels_is_refused_by_default() -> None:
    bomb = image((8000, 8000), mode="1")
    assert len(bomb) < 20_000
    message = refused(chat(image_part(bomb)), DEFAULTS, "media_too_large")
    for needle in ("messages[0].content[0]", "8000x8000", "33554432", "--max-image-pixels"):
        assert needle in message


def test_an_image_just_under_the_default_bound_is_accepted() -> None:
    side = 5792  # 5792 x 5792 = 33_547_264 <= 33_554_432 < 5793 x 5793
    assert check_media(chat(image_part(image((side, side), mode="1"))), DEFAULTS) == 1
    refused(chat(image_part(image((side + 1, side + 1), mode="1"))), DEFAULTS, "media_too_large")


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF"])
def test_every_common_format_is_bounded_by_its_header(fmt: str) -> None:
    limits = bounds(pixels=64 * 64)
    assert check_media(chat(image_part(image((64, 64), fmt))), limits) == 1
    refused(chat(image_part(image((64, 65), fmt))), limits, "media_too_large")


def test_a_large_image_is_read_without_decoding_all_of_its_base64() -> None:
    noise = np.random.default_rng(0).integers(0, 256, (1000, 1000, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(noise).save(out, "PNG")
    url = data_url(out.getvalue(), "image/png")
    broken_tail = url[:-8] + "!!!!!!!!"  # only vLLM's whole decode would meet it
    part = {"type": "image_url", "image_url": {"url": broken_tail}}
    assert check_media(chat(part), bounds(pixels=1000 * 1000)) == 1


# -- video -----------------------------------------------------------------------------------


def test_a_video_whose_frames_exceed_the_pixel_bound_is_refused(tmp_path: Path) -> None:
    part = {
        "type": "video_url",
        "video_url": {"url": data_url(video(tmp_path / "v.mp4", (64, 48), 3), "video/mp4")},
    }
    assert check_media(chat(part), bounds(pixels=64 * 48)) == 1
    message = refused(chat(part), bounds(pixels=64 * 48 - 1), "media_too_large")
    assert "64x48" in message and "--max-image-pixels" in message


def test_a_video_with_more_frames_than_the_bound_is_refused(tmp_path: Path) -> None:
    part = {
        "type": "video_url",
        "video_url": {"url": data_url(video(tmp_path / "v.mp4", (32, 32), 30), "video/mp4")},
    }
    assert check_media(chat(part), bounds(frames=30)) == 1
    message = refused(chat(part), bounds(frames=29), "media_too_large")
    assert "30 frames" in message and "--max-video-frames" in message


def test_a_jpeg_sequence_has_a_frame_per_part_each_bounded_as_an_image() -> None:
    frames = [base64.b64encode(image((32, 32), "JPEG")).decode()] * 4
    big = base64.b64encode(image((32, 33), "JPEG")).decode()
    url = "data:video/jpeg;base64," + ",".join(frames)
    part = {"type": "video_url", "video_url": {"url": url}}
    assert check_media(chat(part), bounds(pixels=32 * 32, frames=4)) == 1
    refused(chat(part), bounds(frames=3), "media_too_large")
    part["video_url"]["url"] = url + "," + big
    message = refused(chat(part), bounds(pixels=32 * 32), "media_too_large")
    assert "(frame 4)" in message


# -- audio -----------------------------------------------------------------------------------


def test_a_wav_longer_than_600_seconds_is_refused_by_default() -> None:
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav(601)).decode(), "format": "wav"},
    }
    message = refused(chat(part), DEFAULTS, "media_too_large")
    assert "601.0 seconds" in message and "600" in message and "--max-audio-seconds" in message
    part["input_audio"]["data"] = base64.b64encode(wav(600)).decode()
    assert check_media(chat(part), DEFAULTS) == 1


def test_an_audio_url_is_bounded_as_input_audio_is() -> None:
    part = {"type": "audio_url", "audio_url": {"url": data_url(wav(3), "audio/wav")}}
    assert check_media(chat(part), bounds(seconds=3)) == 1
    refused(chat(part), bounds(seconds=2.5), "media_too_large")


def test_a_wav_lasts_only_as_long_as_the_samples_it_was_sent_with() -> None:
    claims_more = wav(1, claimed=10_000)
    part = {"type": "audio_url", "audio_url": {"url": data_url(claims_more, "audio/wav")}}
    assert check_media(chat(part), bounds(seconds=2)) == 1


# -- what is left to the instances, and what does not decode ---------------------------------


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "video_url", "video_url": {"url": "http://example.com/a.mp4"}},
        {"type": "image_url", "image_url": {"url": "data:image/png,not-base64"}},
        {"type": "image_embeds", "image_embeds": "data:image/png;base64,AAAA"},
        {"type": "text", "text": "data:image/png;base64,AAAA"},
    ],
    ids=["https", "http", "not_base64", "embeddings", "text"],
)
def test_what_is_not_inline_media_is_not_read(part: dict[str, Any]) -> None:
    assert check_media(chat(part), bounds(pixels=1, frames=1, seconds=0.001)) == 0


@pytest.mark.parametrize(
    "part",
    [
        image_part(b"\x00\x00\x00"),
        image_part(b"not an image at all" * 100),
        {"type": "video_url", "video_url": {"url": data_url(b"not a video" * 100, "video/mp4")}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {
            "type": "input_audio",
            "input_audio": {
                "data": base64.b64encode(b"ID3" + bytes(600)).decode(),
                "format": "mp3",
            },
        },
    ],
    ids=["three_bytes", "not_an_image", "not_a_video", "truncated_wav", "mp3"],
)
def test_media_the_proxy_cannot_read_is_left_to_the_instances(part: dict[str, Any]) -> None:
    assert check_media(chat(part), bounds(pixels=1, frames=1, seconds=0.001)) == 1


@pytest.mark.parametrize(
    "data", ["AAA", "AA=A", "iVBO!!!!", "iVBO\nAAAA"], ids=["length", "padding", "digit", "newline"]
)
def test_base64_that_does_not_decode_is_refused_naming_the_part(data: str) -> None:
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
    message = refused(chat({"type": "text", "text": "first"}, part), DEFAULTS, "bad_request")
    assert "messages[0].content[1]" in message and "base64" in message


def test_parts_are_read_as_vllm_reads_them_not_by_their_type() -> None:
    bomb = data_url(image((8000, 8000), mode="1"), "image/png")
    untyped = {"image_url": {"url": bomb}}
    mistyped_with_uuid = {"type": "text", "text": "", "uuid": "u", "image_url": bomb}
    for part in (untyped, mistyped_with_uuid):
        refused(chat(part), DEFAULTS, "media_too_large")
    response_style = {"type": "input_image", "image_url": bomb}
    refused(chat(response_style), DEFAULTS, "media_too_large")


def test_the_image_formats_are_those_vllm_opens() -> None:
    spec = importlib.util.find_spec("vllm")  # finds vLLM without importing it (seconds)
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    source = (Path(spec.origin).parent / "multimodal" / "image.py").read_text()
    allowed = next(
        ast.literal_eval(node.value)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, ast.Name)
        and node.target.id == "ALLOWED_IMAGE_FORMATS"
        and node.value is not None
    )
    assert set(IMAGE_FORMATS) <= set(allowed)
    assert [f for f in allowed if f in Image.OPEN] == list(IMAGE_FORMATS)
