"""The one error type of the configuration, and how a bad value is shown in its messages.

Every check in this package raises `ConfigError`, whose message names the key, the value and
what is allowed, and optionally where the value came from (an environment variable, a flag or
the extra config) and the other key of a rule that involves two. It survives pickling, so a
worker process can report it to its parent unchanged.
"""

from __future__ import annotations

from typing import Any

from ecshare.errors import ECShareError


class ConfigError(ECShareError, ValueError):
    """A configuration value is wrong; the message names the key, the value and what is allowed."""

    def __init__(
        self,
        key: str | None,
        detail: str,
        *,
        source: str | None = None,
        other: str | None = None,
    ) -> None:
        self.key = key
        self.detail = detail
        self.source = source
        self.other = other  # the second key of a rule that involves two
        where = key if key is not None else "config"
        if source is not None:
            where = f"{where} (from {source})"
        super().__init__(f"{where}: {detail}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (self.key, self.detail, self.source, self.other))


def _rebuild_error(
    key: str | None, detail: str, source: str | None, other: str | None
) -> ConfigError:
    return ConfigError(key, detail, source=source, other=other)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
