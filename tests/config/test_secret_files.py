"""The one check every secret file passes before it is read, and the one way one is written:
only its owner may read it, whatever holds it (an API key, the admin key, the tenant
secret, a CURVE secret key)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ecshare.config import ConfigError
from ecshare.config.secret_files import check_secret_file, read_secret_file, write_secret_file

pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")


def _secret(tmp_path: Path, mode: int, text: str = "a-secret\n") -> Path:
    path = tmp_path / "secret"
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_a_secret_file_only_its_owner_reads_is_read_stripped(tmp_path: Path, mode: int) -> None:
    path = _secret(tmp_path, mode, "  a-secret \n\n")
    check_secret_file(path, "--flag")
    assert read_secret_file(str(path), "--flag") == "a-secret"
    assert read_secret_file(None, "--flag") is None


@pytest.mark.parametrize(
    ("mode", "who"),
    [
        (0o644, "all users"),
        (0o604, "all users"),
        (0o640, "its group"),
        (0o660, "its group"),
        (0o620, "its group"),  # written by its group: as good as chosen by it
    ],
)
def test_a_secret_file_its_group_or_everyone_may_open_is_refused_with_the_chmod(
    tmp_path: Path, mode: int, who: str
) -> None:
    path = _secret(tmp_path, mode)
    with pytest.raises(ConfigError) as info:
        read_secret_file(str(path), "--api-key-file")
    assert info.value.key == "--api-key-file"
    assert f"accessible to {who} (mode {oct(mode)})" in info.value.detail
    assert info.value.detail.endswith(f" Fix it with: chmod 600 {path}")


def test_a_mounted_secret_behind_a_symlink_is_judged_by_its_target(tmp_path: Path) -> None:
    # A Kubernetes Secret volume: the file is a symlink (0777) into a 0400 target.
    target = _secret(tmp_path, 0o400)
    link = tmp_path / "link"
    link.symlink_to(target)
    assert read_secret_file(str(link), "--flag") == "a-secret"
    target.chmod(0o444)
    with pytest.raises(ConfigError, match="accessible to all users"):
        check_secret_file(link, "--flag")


def test_a_missing_file_or_a_directory_is_named_and_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read .*No such file"):
        check_secret_file(tmp_path / "absent", "--flag")
    with pytest.raises(ConfigError, match="not a regular file"):
        check_secret_file(tmp_path, "--flag")


def test_a_written_secret_is_owner_only_whatever_the_umask_and_replaces_the_old(
    tmp_path: Path,
) -> None:
    path = tmp_path / "secret"
    path.write_text("old\n")
    path.chmod(0o644)
    previous = os.umask(0)
    try:
        write_secret_file(path, "new")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_secret_file(str(path), "--flag") == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]  # no staging file left
