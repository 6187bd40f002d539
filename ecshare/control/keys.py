"""CURVE keys: generating, loading and checking them, in ZMQ's own certificate format.

Keys travel through this package as Z85 text in `bytes` (40 characters), the
form `zmq.curve_keypair()` returns, ZMQ certificates store and the ZAP
`User-Id` carries, so a key can be logged, compared and configured without
conversions. Public keys are not secret; secret keys never appear in a repr
or a message.

Every problem raises `ControlConfigError` naming the path (or the inline
value's position) and what to do, because a bad key otherwise shows up much
later as an opaque handshake failure on another host.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import zmq
import zmq.auth
from zmq.utils import z85

from ecshare.config import ConfigError
from ecshare.config.secret_files import check_secret_file
from ecshare.control.errors import ControlConfigError

Z85_KEY_LENGTH: Final = 40
PUBLIC_SUFFIX: Final = ".key"
SECRET_SUFFIX: Final = ".key_secret"

StrPath = str | os.PathLike[str]


def parse_z85_key(value: str | bytes) -> bytes | None:
    """The key as canonical Z85 bytes, or None when `value` is not a 40-character Z85 key."""
    if isinstance(value, str):
        try:
            value = value.encode("ascii")
        except UnicodeEncodeError:
            return None
    if len(value) != Z85_KEY_LENGTH:
        return None
    try:
        raw = z85.decode(value)
    except (KeyError, ValueError, struct.error):  # bad character, or a group over 2**32
        return None
    # Reject spellings that decode but are not what an encoder writes, so that one key
    # has exactly one text form and set membership is exact.
    return value if z85.encode(raw) == value else None


def require_z85_key(value: str | bytes, *, where: str) -> bytes:
    key = parse_z85_key(value)
    if key is None:
        shown = value if isinstance(value, str) else value.decode("ascii", "replace")
        raise ControlConfigError(
            f"{where}: {shown[:60]!r} is not a CURVE key "
            f"(expected {Z85_KEY_LENGTH} characters of Z85, as zmq.curve_keypair() writes)"
        )
    return key


@dataclass(frozen=True)
class KeyPair:
    """One side's CURVE identity: Z85 public and secret key."""

    public: bytes
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        require_z85_key(self.public, where="public key")
        # The secret's text is never echoed back, even in an error.
        if parse_z85_key(self.secret) is None:
            raise ControlConfigError(f"secret key for public key {self.public_text} is not Z85")
        if zmq.curve_public(self.secret) != self.public:
            raise ControlConfigError(
                f"public key {self.public_text} does not belong to the secret key given with it"
            )

    @classmethod
    def generate(cls) -> KeyPair:
        public, secret = zmq.curve_keypair()
        return cls(public=public, secret=secret)

    @property
    def public_text(self) -> str:
        return self.public.decode("ascii")


@dataclass(frozen=True)
class KeyFiles:
    """Where `generate_keypair` wrote a ZMQ certificate pair."""

    public_path: Path
    secret_path: Path


def generate_keypair(directory: StrPath, name: str, *, force: bool = False) -> KeyFiles:
    """Write `<name>.key` (public) and `<name>.key_secret` (mode 0600) into `directory`.

    Refuses to replace existing files unless `force`, because every peer that
    trusts the old public key would start refusing this one.
    """
    if not name or name.startswith(".") or "/" in name or os.sep in name:
        raise ControlConfigError(f"key name {name!r} must be a plain file name, not a path")
    folder = Path(directory)
    public_path = folder / f"{name}{PUBLIC_SUFFIX}"
    secret_path = folder / f"{name}{SECRET_SUFFIX}"
    if not force:
        for path in (public_path, secret_path):
            if path.exists():
                raise ControlConfigError(
                    f"{path} already exists; pass force=True to replace it (peers that "
                    "trust its public key will then refuse the new one)"
                )
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        # zmq.auth writes the secret with the process umask; writing it in a private
        # (0700) staging folder and tightening it before the move means it is never
        # readable by others, not even for a moment.
        staging = tempfile.mkdtemp(prefix=f".{name}.", dir=folder)
        try:
            public_tmp, secret_tmp = zmq.auth.create_certificates(staging, name)
            os.chmod(secret_tmp, 0o600)
            os.chmod(public_tmp, 0o644)
            os.replace(secret_tmp, secret_path)
            os.replace(public_tmp, public_path)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as exc:
        raise ControlConfigError(f"cannot write CURVE keys into {folder}: {exc}") from None
    return KeyFiles(public_path=public_path, secret_path=secret_path)


def load_keypair(secret_file: StrPath) -> KeyPair:
    """Read a `.key_secret` certificate, refusing one that other users can read."""
    path = Path(secret_file)
    if not path.exists():
        raise ControlConfigError(f"secret key file {path} does not exist")
    public, secret = _read_certificate(path)
    if secret is None:
        raise ControlConfigError(
            f"{path} holds no secret key; it looks like a public certificate "
            f"(use the matching {SECRET_SUFFIX} file)"
        )
    _check_secret_file_mode(path)
    public_key = require_z85_key(public, where=f"{path}: public-key")
    if parse_z85_key(secret) is None:
        raise ControlConfigError(f"{path}: secret-key is not a 40-character Z85 key")
    try:
        return KeyPair(public=public_key, secret=secret)
    except ControlConfigError as exc:
        raise ControlConfigError(f"{path}: {exc}") from None


def load_public_key(file_or_z85: StrPath | bytes) -> bytes:
    """A public key given inline (Z85) or as a file: a ZMQ certificate or one Z85 line."""
    if isinstance(file_or_z85, bytes):
        return require_z85_key(file_or_z85, where="public key")
    text = os.fspath(file_or_z85)
    inline = parse_z85_key(text)
    if inline is not None and not os.path.exists(text):
        return inline
    path = Path(text)
    if not path.is_file():
        raise ControlConfigError(
            f"{text!r} is neither a {Z85_KEY_LENGTH}-character Z85 public key nor an existing file"
        )
    keys = _read_key_file(path)
    if len(keys) != 1:
        raise ControlConfigError(f"{path} holds {len(keys)} public keys; expected exactly one")
    return next(iter(keys))


def load_authorized_keys(
    source: StrPath | None, inline: Iterable[str | bytes] = ()
) -> frozenset[bytes]:
    """The client public keys a server admits.

    `source` is a directory of ZMQ `*.key` certificates, a single certificate, or a
    text file with one Z85 key per line (blank lines and `#` comments ignored, text
    after a key's first word too); `inline` adds keys given directly.
    """
    keys: set[bytes] = set()
    if source is not None:
        path = Path(source)
        if path.is_dir():
            certificates = sorted(path.glob(f"*{PUBLIC_SUFFIX}"))
            if not certificates:
                raise ControlConfigError(
                    f"authorized keys directory {path} contains no *{PUBLIC_SUFFIX} certificates"
                )
            for certificate in certificates:
                keys |= _read_key_file(certificate)
        elif path.is_file():
            keys |= _read_key_file(path)
        else:
            raise ControlConfigError(f"authorized keys {path} does not exist")
    for index, value in enumerate(inline):
        keys.add(require_z85_key(value, where=f"inline authorized key #{index + 1}"))
    return frozenset(keys)


def _check_secret_file_mode(path: Path) -> None:
    """The shared secret-file check (`ecshare.config.secret_files`): a secret key its group
    or every user can read is refused, as ssh refuses one, since they could act as this
    instance; raised as this module's error, which the connector's callers expect."""
    try:
        check_secret_file(path, "secret key file")
    except ConfigError as exc:
        raise ControlConfigError(f"secret key file {exc.detail}") from None


def _read_certificate(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except ValueError:
        raise ControlConfigError(f"{path} is not a ZMQ certificate (no public-key line)") from None
    except OSError as exc:
        raise ControlConfigError(f"cannot read certificate {path}: {exc}") from None


def _read_key_file(path: Path) -> set[bytes]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ControlConfigError(f"cannot read key file {path}: {exc}") from None
    if any(line.strip().startswith(b"public-key") for line in data.splitlines()):
        public, _ = _read_certificate(path)
        return {require_z85_key(public, where=f"{path}: public-key")}
    keys: set[bytes] = set()
    for number, raw_line in enumerate(data.splitlines(), start=1):
        words = raw_line.split()
        if not words:
            continue
        # '#' is itself a Z85 character: a line is a key when its first word is one,
        # and must be a comment otherwise.
        key = parse_z85_key(words[0])
        if key is not None:
            keys.add(key)
        elif not raw_line.lstrip().startswith(b"#"):
            shown = raw_line.strip()[:60].decode("ascii", "replace")
            raise ControlConfigError(
                f"{path}:{number}: {shown!r} is not a CURVE public key (expected one "
                f"{Z85_KEY_LENGTH}-character Z85 key per line, or a # comment)"
            )
    if not keys:
        raise ControlConfigError(f"key file {path} contains no public keys")
    return keys
