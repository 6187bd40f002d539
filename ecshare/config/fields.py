"""What a config field is, read from the Struct's annotations, and how one value is checked.

`struct_fields` turns each annotated field of a msgspec Struct into a `_Field`: its name,
default, whether it may be None, the plain type msgspec converts to, and the `_Constraints`
its `Meta` declares (bounds, lengths, a pattern, and the `power_of_two` and `z85` extras that
msgspec itself does not know). `_Field.check` converts one value and raises `ConfigError`
naming the key, the value and what is allowed; the same constraints describe themselves in
words for the error messages, the CLI help and docs/CONFIG.md. This module knows nothing about
which fields `Config` has, so that the Struct can use it without a cycle.
"""

from __future__ import annotations

import functools
import json
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from msgspec import Meta

from ecshare.config.errors import ConfigError, _show

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

ENV_PREFIX = "ECSHARE_"

# Binary units only: "GB" would be read as 10**9 by some and 2**30 by others, so it is refused.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": KiB,
    "kib": KiB,
    "m": MiB,
    "mib": MiB,
    "g": GiB,
    "gib": GiB,
    "t": TiB,
    "tib": TiB,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*")
SIZE_EXAMPLE = "a size such as 65536, 64KiB, 512MiB or 1GiB"


def parse_size(text: str) -> int:
    """'64KiB', '1.5GiB', '4m', '1048576' -> bytes; ValueError naming what is allowed.

    Units are binary (KiB = 1024 bytes; K, M, G, T mean the same); a fraction must come
    to whole bytes.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        hint = " (units are binary: KiB, MiB, GiB, TiB)" if unit.endswith("b") else ""
        raise ValueError(f"got {text!r}, expected {SIZE_EXAMPLE}{hint}")
    value = Fraction(match.group(1)) * _SIZE_UNITS[unit]
    if value.denominator != 1:
        raise ValueError(f"got {text!r}, which is not a whole number of bytes")
    return int(value)


def format_size(nbytes: float) -> str:
    """65536 -> '64 KiB', 1572864 -> '1.5 MiB': the largest unit that keeps it at least 1."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:g} B"


_Z85_ALPHABET = (
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)
_Z85_KEY_PATTERN = "^[" + re.escape(_Z85_ALPHABET) + "]{40}$"

# A CURVE public key as ZMQ writes it: 32 bytes in Z85, 40 characters.
Z85Key = Annotated[
    str,
    Meta(pattern=_Z85_KEY_PATTERN, extra={"z85": True, "allowed": "40-character Z85 string"}),
]


def _metas(tp: Any) -> tuple[Any, list[Meta]]:
    """Split `Annotated[T, Meta, ...]` (nested too) into T and its Metas."""
    metas: list[Meta] = []
    while typing.get_origin(tp) is Annotated:
        metas.extend(m for m in tp.__metadata__ if isinstance(m, Meta))
        tp = tp.__origin__
    return tp, metas


class _Constraints(NamedTuple):
    kind: Any  # int, float, bool, str, tuple or a Literal type
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    extra: Mapping[str, Any] = {}
    item: _Constraints | None = None

    @classmethod
    def of(cls, tp: Any, metas: Sequence[Meta] = ()) -> _Constraints:
        tp, more = _metas(tp)
        metas = [*metas, *more]
        item = None
        if typing.get_origin(tp) is tuple:
            item = cls.of(typing.get_args(tp)[0])
            tp = tuple

        def first(attr: str) -> Any:
            return next((getattr(m, attr) for m in metas if getattr(m, attr) is not None), None)

        extra: dict[str, Any] = {}
        for m in metas:
            extra.update(m.extra or {})
        return cls(
            kind=tp,
            ge=first("ge"),
            gt=first("gt"),
            le=first("le"),
            lt=first("lt"),
            min_length=first("min_length"),
            max_length=first("max_length"),
            pattern=first("pattern"),
            extra=extra,
            item=item,
        )

    def allowed(self) -> str:
        """What is allowed, in words; used in error messages and in docs/CONFIG.md."""
        if "allowed" in self.extra:
            return str(self.extra["allowed"])
        if typing.get_origin(self.kind) is Literal:
            return "one of " + ", ".join(json.dumps(a) for a in typing.get_args(self.kind))
        if self.kind is bool:
            return "true or false"
        if self.kind is tuple:
            words = _length_words(self.min_length, self.max_length, "item") or "any number of items"
            each = self.item.allowed() if self.item is not None else "any string"
            return f"{words}, each {_with_article(each)}"
        if self.kind is str:
            if self.min_length == 1 and self.max_length is None:
                return "non-empty string"
            return _length_words(self.min_length, self.max_length, "character") or "any string"
        noun = "a power of two" if self.extra.get("power_of_two") else "an integer"
        if self.kind is float:
            noun = "a number"
        num, unit = _num, ""
        if self.extra.get("size"):
            noun = "a power of two" if self.extra.get("power_of_two") else "a size"
            num, unit = _size_words, " (bytes, or with a binary unit such as 64KiB or 1GiB)"
        low = self.ge if self.ge is not None else self.gt
        high = self.le if self.le is not None else self.lt
        if self.ge is not None and self.le is not None:
            return f"{noun} between {num(low)} and {num(high)}{unit}"
        limits = []
        if low is not None:
            limits.append(f"{'at least' if self.ge is not None else 'more than'} {num(low)}")
        if high is not None:
            limits.append(f"{'at most' if self.le is not None else 'less than'} {num(high)}")
        return (f"{noun} " + " and ".join(limits) if limits else noun) + unit

    def within(self, value: Any) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if isinstance(value, int | float) and not isinstance(value, bool):
            if self.ge is not None and value < self.ge:
                return False
            if self.gt is not None and value <= self.gt:
                return False
            if self.le is not None and value > self.le:
                return False
            if self.lt is not None and value >= self.lt:
                return False
            power_of_two = self.extra.get("power_of_two")
            if power_of_two and isinstance(value, int) and value & (value - 1):
                return False
        if isinstance(value, str | tuple):
            if self.min_length is not None and len(value) < self.min_length:
                return False
            if self.max_length is not None and len(value) > self.max_length:
                return False
        if isinstance(value, str):
            if self.pattern is not None and re.fullmatch(self.pattern, value) is None:
                return False
            if self.extra.get("z85") and not _z85_decodes(value):
                return False
        return True


class _Field(NamedTuple):
    name: str
    default: Any
    optional: bool
    plain: Any  # the type without Meta or None, for msgspec's strict type check
    constraints: _Constraints
    description: str

    def check(self, value: Any, label: str) -> Any:
        """`value` converted to the field's type, or ConfigError naming `label`."""
        if value is None and self.optional:
            return None
        c = self.constraints
        given = value
        if self.is_size and isinstance(value, str):
            try:
                value = parse_size(value)
            except ValueError as exc:
                raise ConfigError(label, str(exc)) from None
        if c.kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON writers emit 1e9 for big integers
        try:
            converted = msgspec.convert(value, self.plain, strict=True)
        except (msgspec.ValidationError, TypeError, ValueError, OverflowError):
            raise ConfigError(
                label, f"got {_show(value)} ({type(value).__name__}), expected {self.expected}"
            ) from None
        if not c.within(converted):
            raise ConfigError(label, f"got {_show(given)}, expected {c.allowed()}")
        if c.item is not None:
            for i, item in enumerate(converted):
                if not c.item.within(item):
                    raise ConfigError(
                        f"{label}[{i}]", f"got {_show(item)}, expected {c.item.allowed()}"
                    )
        return converted

    @property
    def expected(self) -> str:
        """The type in words, for type errors; a Literal lists its values."""
        kind = self.constraints.kind
        name = self.constraints.allowed() if typing.get_origin(kind) is Literal else self.type_name
        return f"{name} or None" if self.optional and not name.endswith("None") else name

    @property
    def type_name(self) -> str:
        kind = self.constraints.kind
        if typing.get_origin(kind) is Literal:
            name = " | ".join(json.dumps(a) for a in typing.get_args(kind))
        elif kind is tuple:
            name = "list[str]"
        else:
            name = kind.__name__
        return f"{name} | None" if self.optional else name

    @property
    def is_size(self) -> bool:
        """A byte count, which every source may also write with a unit (512MiB, 1GiB)."""
        return bool(self.constraints.extra.get("size"))

    @property
    def env_var(self) -> str:
        return _env_var(self.name)

    @property
    def flag(self) -> str:
        return _flag(self.name)


_TUPLE: Any = tuple  # subscripted with a runtime item type below


@functools.cache
def struct_fields(struct: type[msgspec.Struct]) -> tuple[_Field, ...]:
    """Every field of `struct`, in declaration order, read from its annotations."""
    result = []
    for info in msgspec.structs.fields(struct):
        outer, metas = _metas(info.type)
        members = typing.get_args(outer) if _is_union(outer) else (outer,)
        non_null = [m for m in members if m is not type(None)]
        (inner,) = non_null
        description = next((m.description for m in metas if m.description), "")
        stripped, _ = _metas(inner)
        if typing.get_origin(stripped) is tuple:
            item, _ = _metas(typing.get_args(stripped)[0])
            stripped = _TUPLE[item, ...]
        result.append(
            _Field(
                name=info.name,
                default=info.default,
                optional=len(non_null) < len(members),
                plain=stripped,
                constraints=_Constraints.of(inner, metas),
                description=description,
            )
        )
    return tuple(result)


@functools.cache
def struct_field_map(struct: type[msgspec.Struct]) -> dict[str, _Field]:
    """`struct_fields(struct)` by name."""
    return {f.name: f for f in struct_fields(struct)}


def _env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _render_default(field: _Field) -> str:
    """The default in Markdown, for docs/CONFIG.md and (backticks stripped) the CLI help."""
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, tuple):
        return "`" + ",".join(value) + "`" if value else "empty"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, int) and field.name.endswith("_bytes"):
        for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
            if value >= size and value % size == 0:
                return f"`{value}` ({value // size} {unit})"
    return f"`{value!r}`"


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _z85_decodes(text: str) -> bool:
    """Whether every 5-character group encodes a 32-bit word (85**5 exceeds 2**32)."""
    for start in range(0, len(text), 5):
        word = 0
        for ch in text[start : start + 5]:
            word = word * 85 + _Z85_ALPHABET.index(ch)
        if word > 0xFFFFFFFF:
            return False
    return True


def _length_words(low: int | None, high: int | None, unit: str) -> str:
    if low is not None and low == high:
        return f"exactly {low} {unit}s"
    if low and high is not None:
        return f"{low} to {high} {unit}s"
    if low:
        return f"at least {low} {unit}{'s' if low > 1 else ''}"
    if high is not None:
        return f"at most {high} {unit}s"
    return ""


def _with_article(words: str) -> str:
    if words.startswith(("a ", "an ", "any ", "one ")):
        return words
    return ("an " if words[0] in "aeiou" else "a ") + words


def _size_words(x: float | None) -> str:
    """1048576 -> '1MiB'; a count no unit divides stays in bytes."""
    if x is None:
        return ""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if x >= scale and x % scale == 0:
            return f"{int(x // scale)}{unit}"
    return _num(x)


def _num(x: float | None) -> str:
    if x is None:
        return ""
    return str(int(x)) if float(x).is_integer() else repr(float(x))
