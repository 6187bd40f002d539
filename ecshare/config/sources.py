"""Loading a `Config` from all its sources at once, and the command-line flags for it.

`load_config` layers defaults < `ECSHARE_*` environment < the `extra` dict < command line,
remembering where each value came from so that a `ConfigError` can name it.
`add_config_arguments` gives an argparse parser one flag per field (with `--no-...` for
booleans), and `config_from_args` picks out of the parsed namespace only the flags the user
actually typed.
"""

from __future__ import annotations

import argparse
import os
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal

from ecshare.config.decode import _build, _checked_keys, _parse_text, _values_from_env
from ecshare.config.errors import ConfigError
from ecshare.config.fields import ENV_PREFIX, _Field, _render_default
from ecshare.config.schema import Config, _field_map, _fields


def load_config(
    *,
    extra: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    cli: argparse.Namespace | None = None,
    prefix: str = ENV_PREFIX,
) -> Config:
    """Layer defaults < environment < `extra` dict < command line into one Config.

    `env=None` reads `os.environ`; pass `{}` to ignore the environment. `cli` is a namespace
    from a parser that `add_config_arguments` extended; only flags the user gave count.
    """
    values, sources = _values_from_env(Config, os.environ if env is None else env, prefix)
    if extra is not None:
        for key, value in _checked_keys(Config, extra).items():
            values[key] = value
            sources[key] = "extra config"
    if cli is not None:
        fields = _field_map()
        for key, value in config_from_args(cli).items():
            values[key] = value
            sources[key] = fields[key].flag
    return _build(Config, values, sources)


def add_config_arguments(
    parser: argparse.ArgumentParser, *, title: str = "ecshare configuration"
) -> argparse._ArgumentGroup:
    """Add one `--grant-lease-s` style flag per Config field; booleans get `--no-...` too.

    Flags default to "not given" (argparse.SUPPRESS) so that `config_from_args` can tell a
    value the user typed from a default.
    """
    group = parser.add_argument_group(title)
    for field in _fields():
        default = _render_default(field).replace("`", "")
        help_text = f"{field.description} [default: {default}; env: {field.env_var}]"
        help_text = help_text.replace("%", "%%")
        if field.constraints.kind is bool:
            group.add_argument(
                field.flag,
                dest=field.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
            continue
        group.add_argument(
            field.flag,
            dest=field.name,
            type=_argument_type(field),
            default=argparse.SUPPRESS,
            metavar=_metavar(field),
            help=help_text,
        )
    return group


def _argument_type(field: _Field) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return field.check(_parse_text(field, text, field.name, field.flag), field.name)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(e.detail) from None

    return parse


def _metavar(field: _Field) -> str:
    kind = field.constraints.kind
    if typing.get_origin(kind) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(kind)) + "}"
    for suffix, metavar in (("_s", "SECONDS"), ("_bytes", "BYTES"), ("_file", "PATH")):
        if field.name.endswith(suffix):
            return metavar
    if kind is tuple:
        return "A,B,..."
    return "N" if kind is int else field.name.rsplit("_", 1)[-1].upper()


def config_from_args(namespace: argparse.Namespace) -> dict[str, Any]:
    """The config values among `namespace`'s attributes: only the flags the user gave."""
    given = vars(namespace)
    return {f.name: given[f.name] for f in _fields() if f.name in given}
