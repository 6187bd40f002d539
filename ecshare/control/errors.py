"""The errors the control plane raises to its callers.

Everything that comes off the wire is dropped and counted rather than raised
(see `ControlServer.stats`); these are for the local side: a configuration
that cannot work, or a peer that refused us for good.
"""

from __future__ import annotations

from ecshare.errors import ECShareError


class ControlError(ECShareError):
    """Base of every error the control plane raises."""


class ControlConfigError(ControlError, ValueError):
    """A key file, allow-list or option is unusable; the message names the path or option."""


class AuthenticationFailed(ControlError):
    """A producer refused this consumer's handshake (or we refused it), so retrying cannot help.

    Raised by `ControlClient.check()`; the message says which side's key is at fault and
    what to change.
    """

    def __init__(self, endpoint: str, reason: str) -> None:
        super().__init__(reason)
        self.endpoint = endpoint
        self.reason = reason

    def __reduce__(self) -> tuple[type[AuthenticationFailed], tuple[str, str]]:
        return (type(self), (self.endpoint, self.reason))
