"""The one check every secret file passes before it is read: API keys, the admin key, the
tenant secret and CURVE secret keys alike; and the one way a secret file is written.

A secret file must be a regular file that only its owner can read (`chmod 600`, or 400):
one its group or every user on the host can read lets them act as whoever holds it (a
tenant, the operator, an instance), so it is refused, as ssh refuses such a key, with the
command that fixes it. A Kubernetes Secret mounted with `defaultMode: 0400` passes (its
files are symlinks into the volume, and the check follows them, as a read does).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ecshare.config.errors import ConfigError


def check_secret_file(path: str | os.PathLike[str], flag: str) -> None:
    """Raise `ConfigError` (naming `flag`) unless `path` is a regular file that only its
    owner may read."""
    shown = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(flag, f"cannot read {shown!r}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ConfigError(flag, f"{shown!r} is not a regular file")
    if os.name == "nt":
        return
    if mode & 0o077:
        who = "all users" if mode & 0o007 else "its group"
        raise ConfigError(
            flag,
            # `ecshare doctor` splits a refusal at " Fix it with: " into finding and fix.
            f"{shown!r} is accessible to {who} (mode {oct(stat.S_IMODE(mode))}), who could "
            f"act with the secret it holds. Fix it with: chmod 600 {shown}",
        )


def read_secret_file(path: str | None, flag: str) -> str | None:
    """The stripped text of the secret file `path` once it passes `check_secret_file`;
    None where no path is given."""
    if path is None:
        return None
    check_secret_file(path, flag)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(flag, f"cannot read {path!r}: {exc}") from None


def write_secret_file(path: Path, text: str) -> None:
    """Write `text` (and a newline) to `path`, readable by its owner only from the first
    byte on: created with mode 0600 under a temporary name, then moved into place."""
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text + "\n")
        os.replace(staging, path)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
