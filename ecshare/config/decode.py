"""Raw input to field values: unknown keys, text from env vars and flags, and blame.

The steps every source shares on the way into a Struct: `_checked_keys` rejects a key the
Struct does not have (suggesting the closest one), `_parse_text` turns the string of an
environment variable or a flag into a field's value, `_values_from_env` collects the
`ECSHARE_*` variables, and `_build` constructs the Struct and, when that raises, names the
source of the offending value in the `ConfigError`. Each takes the Struct type as an
argument, so that `Config`'s own constructors in schema.py can use them without a cycle.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec

from ecshare.config.errors import ConfigError, _show
from ecshare.config.fields import SIZE_EXAMPLE, _Field, parse_size, struct_field_map

_S = TypeVar("_S", bound=msgspec.Struct)

# ECSHARE_* variables that are not config keys and so are not rejected as unknown (named
# without the prefix); add a name here, documented, before anything reads such a variable.
# PROXY_API_KEY: the API key `ecshare proxy` requires of its clients (ecshare.apps.proxy.config).
_ENV_ALLOWLIST: frozenset[str] = frozenset({"PROXY_API_KEY"})


def _checked_keys(struct: type[msgspec.Struct], data: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(None, f"got {_show(data)} ({type(data).__name__}), expected a mapping")
    known = struct_field_map(struct)
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(None, f"got key {_show(key)} ({type(key).__name__}), expected str")
        if key not in known:
            label = key if key.isidentifier() else repr(key)
            raise ConfigError(label, "unknown key" + _did_you_mean(key, list(known)))
    return dict(data)


def _did_you_mean(word: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if close:
        return f"; did you mean `{close[0]}`?"
    return "; docs/CONFIG.md lists every key"


def _build(cls: type[_S], values: Mapping[str, Any], sources: Mapping[str, str]) -> _S:
    try:
        return cls(**values)
    except ConfigError as e:
        key = e.key.split("[", 1)[0] if e.key else None
        source = sources.get(key) if key is not None else None
        detail = e.detail
        other = sources.get(e.other) if e.other is not None else None
        if other is not None and other.startswith("--"):
            # A person typed it: name it as they did.
            detail = re.sub(rf"\b{e.other}\b", other, detail)
        elif other is not None:
            detail += f" ({e.other} was set by {other})"
        if source is not None and source.startswith("--") and e.key is not None:
            label = source + e.key[len(key or "") :]
            raise ConfigError(label, detail, other=e.other) from None
        if source is None and detail == e.detail:
            raise
        raise ConfigError(e.key, detail, source=source, other=e.other) from None


_BOOL_WORDS = {
    "1": True,
    "0": False,
    "true": True,
    "false": False,
    "yes": True,
    "no": False,
    "on": True,
    "off": False,
}


def _parse_text(field: _Field, text: str, label: str, source: str) -> Any:
    """A string from the environment or the command line, parsed for `field`."""
    raw = text.strip()
    kind = field.constraints.kind
    if field.optional and raw.lower() in ("", "none"):
        return None
    try:
        if kind is bool:
            return _BOOL_WORDS[raw.lower()]
        if field.is_size:
            return parse_size(raw)
        if kind is int:
            return int(raw)
        if kind is float:
            return float(raw)
        if kind is tuple:
            return tuple(part.strip() for part in raw.split(",") if part.strip())
    except (KeyError, ValueError):
        expected = "one of " + ", ".join(_BOOL_WORDS) if kind is bool else kind.__name__
        if field.is_size:
            expected = SIZE_EXAMPLE
        raise ConfigError(label, f"got {_show(text)}, expected {expected}", source=source) from None
    return raw


def _values_from_env(
    struct: type[msgspec.Struct], environ: Mapping[str, str], prefix: str
) -> tuple[dict[str, Any], dict[str, str]]:
    fields = struct_field_map(struct)
    by_var = {prefix + name.upper(): f for name, f in fields.items()}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for var in sorted(environ):
        if not var.startswith(prefix) or var[len(prefix) :] in _ENV_ALLOWLIST:
            continue
        field = by_var.get(var)
        if field is None:
            hint = _did_you_mean(var.upper(), list(by_var))
            raise ConfigError(var, "unknown environment variable" + hint)
        values[field.name] = _parse_text(field, environ[var], field.name, var)
        sources[field.name] = var
    return values, sources
