"""The salt that keeps one tenant's media entries apart from another's (`--tenant-isolation`)
is keyed: an HMAC of the tenant's name under the proxy's tenant secret. Whoever can put
`media_io_kwargs` on an instance cannot compute a named tenant's salt without the secret,
and every proxy given the same secret salts a tenant alike."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
from proxy_testing import ProxyUnderTest, Rig, chat

from ecshare.apps.cli import parse_args
from ecshare.apps.proxy.config import config_from_args
from ecshare.apps.proxy.parts import PartRules
from ecshare.apps.proxy.tenants import SALT_FIELD, new_tenant_secret, tenant_salt
from ecshare.config import ConfigError

SECRET = "a-tenant-secret-of-32-characters-or-more"
OTHER = "another-tenant-secret-of-32-characters"
KEYS = {"key-of-team-a-0123": "team-a"}
AS_A = {"Authorization": "Bearer key-of-team-a-0123"}


def unkeyed(tenant: str) -> str:
    """The salt as it was: a digest of the name alone, which anyone can compute."""
    return hashlib.sha256(b"ecshare-tenant-salt\x00" + tenant.encode()).hexdigest()[:32]


def test_a_tenants_salt_cannot_be_computed_from_its_name_alone() -> None:
    for tenant in ("default", "team-a"):
        assert tenant_salt(SECRET, tenant) != unkeyed(tenant)
        assert tenant_salt(SECRET, tenant) != tenant_salt(OTHER, tenant)
        assert len(tenant_salt(SECRET, tenant)) == 32


def test_one_secret_gives_one_salt_per_tenant_and_tenants_apart() -> None:
    assert tenant_salt(SECRET, "team-a") == tenant_salt(SECRET, "team-a")
    assert tenant_salt(SECRET, "team-a") != tenant_salt(SECRET, "team-b")
    made = {new_tenant_secret() for _ in range(3)}
    assert len(made) == 3 and all(len(s) >= 32 for s in made)


def _salt_sent(rig: Rig, proxy: ProxyUnderTest, n: int) -> str:
    image = {"type": "image_url", "image_url": {"url": f"https://example.com/{n}.jpg"}}
    assert proxy.post("/v1/chat/completions", chat(image), headers=AS_A).status_code == 200
    bodies: list[dict[str, Any]] = [b for stub in rig.encoders for b in stub.bodies()]
    salt: str = bodies[-1]["media_io_kwargs"]["image"][SALT_FIELD]
    return salt


def test_two_proxies_with_one_secret_salt_a_tenant_alike_and_without_it_apart(rig: Rig) -> None:
    one, two = (
        rig.start_proxy(tenant_isolation=True, api_keys=KEYS, tenant_secret=SECRET)
        for _ in range(2)
    )
    own = rig.start_proxy(tenant_isolation=True, api_keys=KEYS)  # makes its own secret
    salts = [_salt_sent(rig, proxy, n) for n, proxy in enumerate((one, two, own))]
    assert salts[0] == salts[1] == tenant_salt(SECRET, "team-a")
    assert salts[2] not in (salts[0], unkeyed("team-a"))
    assert SECRET not in repr(one.proxy.config)
    assert SECRET not in repr(PartRules.of(one.proxy.config))


def test_the_tenant_secret_comes_from_its_file_never_shows_and_is_long_enough(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tenant_secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)

    def config(*flags: str) -> Any:
        return config_from_args(parse_args(["proxy", "--pd", "http://a:1", *flags]), {})

    given = config("--tenant-isolation", "--tenant-secret-file", str(path))
    assert given.tenant_secret == SECRET and SECRET not in repr(given)
    path.write_text("short\n")
    with pytest.raises(ConfigError, match="shorter than 32"):
        config("--tenant-secret-file", str(path))
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="accessible to its group"):
        config("--tenant-secret-file", str(path))
