"""CURVE key files: written safely, read strictly, every mistake named with its path."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ecshare.control import (
    ControlConfigError,
    KeyPair,
    generate_keypair,
    load_authorized_keys,
    load_keypair,
    load_public_key,
)

pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_generated_keys_load_back_and_secret_is_0600(tmp_path: Path) -> None:
    files = generate_keypair(tmp_path / "keys", "producer")
    assert files.public_path.name == "producer.key"
    assert files.secret_path.name == "producer.key_secret"
    assert _mode(files.secret_path) == 0o600
    assert _mode(files.public_path) == 0o644
    keys = load_keypair(files.secret_path)
    assert zmq.curve_public(keys.secret) == keys.public
    assert load_public_key(files.public_path) == keys.public
    assert load_public_key(files.secret_path) == keys.public  # its public half
    assert load_public_key(keys.public_text) == keys.public
    assert load_public_key(keys.public) == keys.public
    # No staging leftovers next to the keys.
    assert sorted(p.name for p in files.public_path.parent.iterdir()) == [
        "producer.key",
        "producer.key_secret",
    ]


def test_secret_key_never_appears_in_repr(tmp_path: Path) -> None:
    keys = KeyPair.generate()
    assert keys.secret.decode() not in repr(keys)
    assert keys.public.decode() in repr(keys)


def test_existing_keys_are_not_overwritten_unless_forced(tmp_path: Path) -> None:
    first = load_keypair(generate_keypair(tmp_path, "p").secret_path)
    with pytest.raises(ControlConfigError, match=r"p\.key.* already exists.*force=True"):
        generate_keypair(tmp_path, "p")
    assert load_keypair(tmp_path / "p.key_secret") == first
    second = load_keypair(generate_keypair(tmp_path, "p", force=True).secret_path)
    assert second != first


def test_key_name_must_not_be_a_path(tmp_path: Path) -> None:
    with pytest.raises(ControlConfigError, match="plain file name"):
        generate_keypair(tmp_path, "../evil")


def test_world_readable_secret_is_refused_with_chmod_hint(tmp_path: Path) -> None:
    files = generate_keypair(tmp_path, "p")
    files.secret_path.chmod(0o644)
    with pytest.raises(ControlConfigError) as info:
        load_keypair(files.secret_path)
    message = str(info.value)
    assert str(files.secret_path) in message
    assert "0o644" in message
    assert f"chmod 600 {files.secret_path}" in message


def test_group_readable_secret_is_refused_with_chmod_hint(tmp_path: Path) -> None:
    # Its group could act as this instance: refused as the proxy refuses its key files.
    files = generate_keypair(tmp_path, "p")
    files.secret_path.chmod(0o640)
    with pytest.raises(ControlConfigError) as info:
        load_keypair(files.secret_path)
    message = str(info.value)
    assert "accessible to its group (mode 0o640)" in message
    assert f"chmod 600 {files.secret_path}" in message


def test_an_owner_only_secret_loads(tmp_path: Path) -> None:
    files = generate_keypair(tmp_path, "p")
    for mode in (0o600, 0o400):
        files.secret_path.chmod(mode)
        assert load_keypair(files.secret_path).public == load_public_key(files.public_path)


def test_loading_a_public_certificate_as_key_pair_says_so(tmp_path: Path) -> None:
    files = generate_keypair(tmp_path, "p")
    with pytest.raises(ControlConfigError, match=r"no secret key.*key_secret"):
        load_keypair(files.public_path)
    with pytest.raises(ControlConfigError, match="does not exist"):
        load_keypair(tmp_path / "missing.key_secret")


def test_mismatched_key_pair_is_refused() -> None:
    a, b = KeyPair.generate(), KeyPair.generate()
    with pytest.raises(ControlConfigError, match="does not belong"):
        KeyPair(public=a.public, secret=b.secret)


@pytest.mark.parametrize(
    "bad",
    [
        "short",
        "x" * 39 + "~",  # '~' is not Z85
        "%" * 40,  # Z85 characters, but each group overflows 32 bits
        "é" * 40,
    ],
)
def test_bad_z85_is_rejected(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ControlConfigError):
        load_public_key(bad)
    with pytest.raises(ControlConfigError, match="inline authorized key #2"):
        load_authorized_keys(None, [KeyPair.generate().public_text, bad])
    keyfile = tmp_path / "authorized"
    keyfile.write_text(f"# header\n{KeyPair.generate().public_text}\n{bad}\n", encoding="utf-8")
    with pytest.raises(ControlConfigError, match=rf"{keyfile}:3"):
        load_authorized_keys(keyfile)


def test_authorized_keys_file_with_comments(tmp_path: Path) -> None:
    alice, bob = KeyPair.generate(), KeyPair.generate()
    keyfile = tmp_path / "authorized"
    keyfile.write_text(
        "# consumers of producer-1\n"
        "\n"
        f"{alice.public_text}   alice on host-a\n"
        f"   {bob.public_text}\n"
        "#   a comment that is not a key\n"
    )
    assert load_authorized_keys(keyfile) == {alice.public, bob.public}
    extra = KeyPair.generate()
    assert extra.public in load_authorized_keys(keyfile, [extra.public_text])


def test_authorized_keys_directory_of_certificates(tmp_path: Path) -> None:
    folder = tmp_path / "clients"
    a = generate_keypair(folder, "a")
    b = generate_keypair(folder, "b")
    expected = {load_public_key(a.public_path), load_public_key(b.public_path)}
    assert load_authorized_keys(folder) == expected
    assert load_authorized_keys(a.public_path) == {load_public_key(a.public_path)}


def test_authorized_keys_problems_name_the_path(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ControlConfigError, match=rf"{empty} contains no \*\.key"):
        load_authorized_keys(empty)
    with pytest.raises(ControlConfigError, match=rf"{tmp_path / 'nope'} does not exist"):
        load_authorized_keys(tmp_path / "nope")
    comments_only = tmp_path / "comments"
    comments_only.write_text("# nobody yet\n")
    with pytest.raises(ControlConfigError, match=rf"{comments_only} contains no public keys"):
        load_authorized_keys(comments_only)
    assert load_authorized_keys(None) == frozenset()


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    notes=st.lists(st.text(alphabet=st.characters(codec="ascii"), max_size=30), max_size=6),
    count=st.integers(min_value=1, max_value=6),
)
def test_authorized_keys_file_round_trips(tmp_path: Path, notes: list[str], count: int) -> None:
    keys = [KeyPair.generate().public for _ in range(count)]
    lines = [f"{key.decode()}  {_one_line(note)}" for key, note in zip(keys, notes, strict=False)]
    lines += [key.decode() for key in keys[len(notes) :]]
    lines += [f"# {_one_line(note)}" for note in notes]
    keyfile = tmp_path / "authorized"
    keyfile.write_text("\n".join(lines) + "\n")
    assert load_authorized_keys(keyfile) == frozenset(keys)
