"""The one typed configuration of an ecshare instance.

`Config` is the single source of truth: vLLM's `ec_connector_extra_config` (a dict), the
`ECSHARE_*` environment variables and the command line all decode into it, and the config
reference, docs/CONFIG.md, is generated from it (`make config-doc`).

Every check runs when a `Config` is constructed, so an invalid one cannot exist, and every
bad value raises one error type, `ConfigError`, whose message names the key, the value and
what is allowed.

Precedence, lowest first: defaults < environment < dict (`extra`) < command line. The dict is
the deployment's explicit per-connector setting, so it overrides ambient environment variables;
flags typed by a person override both.

Layout, each module depending only on those before it: errors (`ConfigError`), fields (reading
a Struct's annotations and checking one value), decode (raw input to field values), schema
(`Config` and its cross-field rules), sources (`load_config` and the CLI flags) and reference
(the generated docs/CONFIG.md and `python -m ecshare.config`).

May import: ecshare.errors.
"""

from ecshare.config.errors import ConfigError
from ecshare.config.fields import ENV_PREFIX
from ecshare.config.fields import GiB as GiB
from ecshare.config.fields import KiB as KiB
from ecshare.config.fields import MiB as MiB
from ecshare.config.fields import TiB as TiB
from ecshare.config.fields import Z85Key as Z85Key
from ecshare.config.reference import FieldDoc, describe_fields, render_reference_markdown
from ecshare.config.reference import main as main
from ecshare.config.schema import Config
from ecshare.config.schema import Seconds as Seconds
from ecshare.config.sources import add_config_arguments, config_from_args, load_config

__all__ = [
    "ENV_PREFIX",
    "Config",
    "ConfigError",
    "FieldDoc",
    "add_config_arguments",
    "config_from_args",
    "describe_fields",
    "load_config",
    "render_reference_markdown",
]

# Tracebacks name the error `ecshare.config.ConfigError`, as before the split. Only this class:
# msgspec resolves `Config`'s annotations in the module its `__module__` names.
ConfigError.__module__ = __name__
