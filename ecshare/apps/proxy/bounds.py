"""Inline media bounded by what it decodes to, read from its header before any encoder call.

A few hundred kilobytes of PNG can decode to 8000x8000 pixels, and every instance that
gets the item (an encoder, then prefill/decode where it keeps its media) decodes it. So
each inline item of a chat request (a `data:` URL in an `image_url`, `input_image`,
`video_url` or `audio_url` part, or an `input_audio` part's base64 `data`; parts read as
vLLM reads them, `parts.part_kind`) is measured from its header, and the request is
refused (400, `media_too_large`, counted in `rejected_total{reason}`) when:

* an image has more than `--max-image-pixels` pixels (width x height, as Pillow's lazy
  `Image.open` reads them: no pixel is decoded);
* a video's frame has more than `--max-image-pixels` pixels, or the video more than
  `--max-video-frames` frames: read with OpenCV, as vLLM's default video loader reads
  them (the container's frame size and frame count, the same figures vLLM checks); a
  `video/jpeg` data URL (vLLM's comma-separated JPEG frames) has as many frames as it
  has parts, each bounded as an image;
* a WAV lasts longer than `--max-audio-seconds` (stdlib `wave`: the samples its data
  chunk holds, at most as many as the bytes sent do).

Only what must be read is decoded: an image's or a WAV's base64 is decoded as far as Pillow
or `wave` read (`_Base64File`, a buffer's worth at a time) and never copied out of the
request, so a 4 MB image costs about what a small one does (but a WebP: Pillow's WebP reader
takes the whole file at open, so its check costs in proportion to its size, with no pixel
decoded); a video is decoded whole, as a container's index may be at its end. Opening a
video runs FFmpeg's stream probe, which for some codecs decodes the first frame (MPEG-4
part 2 does; MJPEG in AVI does not): the proxy checks a request with a video in a
thread of its own (`carries_video`).

What the proxy cannot read, it leaves to the instances, which check the same items
themselves (`VLLM_MAX_IMAGE_PIXELS`, `VLLM_MAX_AUDIO_DECODE_DURATION_S`) and refuse what
they cannot decode:

* anything the proxy's Pillow does not identify as an image of vLLM's allowed formats
  (the instances' Pillow may know a format this one does not), and a video OpenCV cannot
  open;
* audio other than WAV (MP3, FLAC, OGG, ...): no header reader for them is installed
  with the proxy (vLLM reads them with torchcodec, soundfile or PyAV, and bounds their
  decoded duration as it decodes), and WAVs `wave` cannot read (in Python 3.11, float
  and extensible ones);
* a data URL that is not base64 (vLLM 0.32 refuses it), and base64 beyond what the
  headers needed: vLLM decodes it strictly (`pybase64.b64decode(validate=True)`) and
  refuses it. Base64 the proxy had to read and could not decode is refused here (400,
  `bad_request`), as the instance would have.

An `http(s)://` URL is fetched by the instances, not by the proxy, so its size is theirs to
bound: the operator restricts where they fetch from with vLLM's `--allowed-media-domains`
and bounds what they decode with `VLLM_MAX_IMAGE_PIXELS` (images and video frames),
`VLLM_MAX_AUDIO_DECODE_DURATION_S` and `VLLM_MAX_AUDIO_CLIP_FILESIZE_MB`.
"""

from __future__ import annotations

import functools
import io
import wave
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pybase64
from PIL import Image

from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.errors import ProxyError
from ecshare.apps.proxy.parts import EMBEDS, MODALITY, part_kind

# The image formats vLLM 0.32 opens untrusted media with (vllm/multimodal/image.py,
# ALLOWED_IMAGE_FORMATS), of those this Pillow knows: the proxy runs no parser that the
# instances would not.
_VLLM_IMAGE_FORMATS = (
    *("AVIF", "BLP", "BMP", "CUR", "DCX", "DDS", "DIB", "FITS", "FLI", "FTEX", "GBR", "GIF"),
    *("ICNS", "ICO", "IM", "IMT", "IPTC", "JPEG", "JPEG2000", "MCIDAS", "MSP", "PCD", "PCX"),
    *("PIXAR", "PNG", "PPM", "PSD", "QOI", "SGI", "SPIDER", "SUN", "TGA", "TIFF", "WEBP"),
    *("XBM", "XPM", "XVTHUMB"),
)
Image.init()
IMAGE_FORMATS = tuple(f for f in _VLLM_IMAGE_FORMATS if f in Image.OPEN)


@functools.cache
def _video_backend() -> tuple[Any, int | None]:
    """OpenCV, and the first of its backends that reads a stream from memory, as vLLM
    picks it. Imported at the first video: it costs a proxy process about 150 ms and
    30 MiB, which one that never sees a video need not pay."""
    import cv2

    backends = cv2.videoio_registry.getStreamBufferedBackends()
    usable = (b for b in backends if cv2.videoio_registry.hasBackend(b))
    return cv2, next(usable, None)


# The field that holds a part's media, where it is not named after the part's kind.
_FIELD = {"input_image": "image_url"}  # the Responses API's image part
# The flag that sets each bound, for the messages.
_FLAGS = {
    "pixels": "--max-image-pixels",
    "frames": "--max-video-frames",
    "seconds": "--max-audio-seconds",
}


@dataclass(frozen=True)
class MediaBounds:
    """The most an inline item may decode to (see the module docstring)."""

    max_image_pixels: int
    max_video_frames: int
    max_audio_seconds: float

    @classmethod
    def of(cls, config: ProxyConfig) -> MediaBounds:
        return cls(config.max_image_pixels, config.max_video_frames, config.max_audio_seconds)


@dataclass(frozen=True)
class InlineItem:
    """One media item a request carries in a base64 `data:` URL."""

    where: str  # the part, as `messages[M].content[C]`
    modality: str
    media_type: str  # as the data URL names it ("image/png"); may be empty
    text: str  # the string that holds the base64 (the URL: slicing it out would copy it)
    start: int  # where the base64 begins in `text`


def check_media(body: Mapping[str, Any], bounds: MediaBounds) -> int:
    """The number of inline items of the chat request `body`, each read from its header;
    raises `ProxyError` (400) for one that decodes to more than `bounds` allow, or whose
    base64 does not decode."""
    count = 0
    for item in inline_items(body):
        count += 1
        if item.modality == "image":
            _check_image(item.where, _open(item.where, item.text, item.start), bounds)
        elif item.modality == "video":
            _check_video(item, bounds)
        else:
            _check_audio(item, bounds)
    return count


def carries_video(body: Mapping[str, Any]) -> bool:
    """Whether the chat request `body` has an inline video, whose check (FFmpeg's probe
    of the whole container) is worth a thread of its own off the proxy's event loop."""
    return any(item.modality == "video" for item in inline_items(body))


def inline_items(body: Mapping[str, Any]) -> Iterator[InlineItem]:
    """The inline media items of a chat request, in order (embeddings are not media)."""
    messages = body.get("messages")
    for m, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for c, part in enumerate(content if isinstance(content, list) else ()):
            kind = part_kind(part) if isinstance(part, dict) else None
            if kind is None or kind in EMBEDS or kind not in MODALITY:
                continue
            value = part.get(_FIELD.get(kind, kind))
            item = _inline(f"messages[{m}].content[{c}]", MODALITY[kind], value)
            if item is not None:
                yield item


def _inline(where: str, modality: str, value: Any) -> InlineItem | None:
    if modality == "audio" and isinstance(value, dict) and "data" in value:  # input_audio
        data, audio_format = value.get("data"), value.get("format", "")
        if isinstance(data, str) and data:
            return InlineItem(where, modality, f"audio/{audio_format}", data, 0)
        return None
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or url[:5].lower() != "data:":
        return None
    # As vLLM parses a data URL (RFC 2397): data:[<mediatype>][;<param>=<value>]*;base64,<data>
    comma = url.find(",", 5)
    media_type, semicolon, encoding = url[5:comma].rpartition(";")
    if comma < 0 or not semicolon or encoding != "base64":
        return None
    return InlineItem(where, modality, media_type.partition(";")[0], url, comma + 1)


def _check_image(where: str, file: io.BufferedReader, bounds: MediaBounds) -> None:
    try:
        with Image.open(file, formats=IMAGE_FORMATS) as image:
            width, height = image.size
    except ProxyError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # Pillow's own bound (twice Image.MAX_IMAGE_PIXELS) refuses it in vLLM too.
        limit = 2 * (Image.MAX_IMAGE_PIXELS or 0)
        raise _too_large(where, f"more than {limit} pixels", "pixels", bounds) from None
    except Exception:  # what this Pillow cannot read is the instances' to refuse
        return
    if width * height > bounds.max_image_pixels:
        decoded = f"{width}x{height} = {width * height} pixels"
        raise _too_large(where, decoded, "pixels", bounds)


def _check_video(item: InlineItem, bounds: MediaBounds) -> None:
    if item.media_type.lower() == "video/jpeg":
        jpegs = item.text[item.start :].split(",")
        _check_frames(item.where, len(jpegs), bounds)
        for i, jpeg in enumerate(jpegs):
            where = f"{item.where} (frame {i})"
            _check_image(where, _open(where, jpeg), bounds)
        return
    cv2, backend = _video_backend()
    if backend is None:
        return
    data = io.BytesIO(
        _open(item.where, item.text, item.start).read()
    )  # whole: a container's index may be at its end
    try:
        # OpenCV's stubs name its own reader; it reads any io.BufferedIOBase, as in vLLM.
        capture = cv2.VideoCapture(data, backend, [])
    except cv2.error:
        return
    try:
        if not capture.isOpened():
            return
        width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        frames = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    finally:
        capture.release()
    if width * height > bounds.max_image_pixels:
        decoded = f"frames of {width}x{height} = {width * height} pixels"
        raise _too_large(item.where, decoded, "pixels", bounds)
    _check_frames(item.where, frames, bounds)


def _check_frames(where: str, frames: int, bounds: MediaBounds) -> None:
    if frames > bounds.max_video_frames:
        raise _too_large(where, f"{frames} frames", "frames", bounds)


def _check_audio(item: InlineItem, bounds: MediaBounds) -> None:
    raw = _Base64File(item.where, item.text, item.start)
    file = io.BufferedReader(raw)
    try:
        with wave.open(file) as audio:
            rate = audio.getframerate()
            frame_bytes = audio.getsampwidth() * audio.getnchannels()
            declared = audio.getnframes()
    except ProxyError:
        raise
    except Exception:  # not a WAV `wave` reads: the instances bound it as they decode
        return
    # `wave` stops at the start of the data chunk; a header may claim more than was sent.
    present = (raw.size - file.tell()) // frame_bytes if frame_bytes > 0 else 0
    seconds = min(declared, present) / rate if rate > 0 else 0.0
    if seconds > bounds.max_audio_seconds:
        raise _too_large(item.where, f"{seconds:.1f} seconds", "seconds", bounds)


def _too_large(where: str, decoded: str, unit: str, bounds: MediaBounds) -> ProxyError:
    bound = {
        "pixels": bounds.max_image_pixels,
        "frames": bounds.max_video_frames,
        "seconds": f"{bounds.max_audio_seconds:g}",
    }[unit]
    return ProxyError(
        400,
        f"{where}: the inline media decodes to {decoded}, more than the {bound} {unit} "
        f"allowed (the proxy's {_FLAGS[unit]})",
        reason="media_too_large",
    )


def _open(where: str, text: str, start: int = 0) -> io.BufferedReader:
    """The base64 of `text` from `start` on, as a file of the bytes it encodes."""
    return io.BufferedReader(_Base64File(where, text, start))


class _Base64File(io.RawIOBase):
    """Base64 text read as the bytes it encodes, decoding only the groups of four characters
    that a reader reaches, as strictly as vLLM decodes the whole (`validate=True`); a group
    that does not decode raises `ProxyError` (400, `bad_request`) naming `where`."""

    def __init__(self, where: str, text: str, start: int = 0) -> None:
        super().__init__()
        self._where = where
        self._text = text
        self._start = start
        if (len(text) - start) % 4:
            raise self._undecodable("its length is not a multiple of 4")
        padding = 2 if text.endswith("==") else 1 if text.endswith("=") else 0
        self.size = (len(text) - start) // 4 * 3 - padding
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self.size}[whence]
        if start + offset < 0:
            raise ValueError(f"negative seek position {start + offset}")
        self._position = start + offset
        return self._position

    def readall(self) -> bytes:  # at once: the default reads a buffer's worth at a time
        return self.read(max(0, self.size - self._position)) or b""

    def readinto(self, buffer: Any) -> int:
        end = min(self.size, self._position + len(buffer))
        if end <= self._position:
            return 0
        first, last = self._position // 3, -(-end // 3)  # the groups holding the bytes
        groups = self._text[self._start + 4 * first : self._start + 4 * last]
        try:
            decoded = pybase64.b64decode(groups, validate=True)
        except ValueError as exc:
            raise self._undecodable(str(exc)) from None
        begin = self._position - 3 * first
        count = end - self._position
        buffer[:count] = decoded[begin : begin + count]
        self._position = end
        return count

    def _undecodable(self, why: str) -> ProxyError:
        return ProxyError(
            400,
            f"{self._where}: the data URL's base64 does not decode ({why})",
            reason="bad_request",
        )
