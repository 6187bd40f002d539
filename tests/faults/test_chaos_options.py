"""What `ecshare chaos` accepts, and the clear error for what it does not: no process starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ecshare.apps.chaos.options import FAULT_KINDS, MID_READ_KINDS, PUSH_KINDS, ChaosOptions


def _chaos(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ecshare", "chaos", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_every_mid_read_kind_is_a_fault_kind() -> None:
    assert set(MID_READ_KINDS) <= set(FAULT_KINDS)
    assert "shrink_lease" in FAULT_KINDS and "cut_control" in FAULT_KINDS


def test_options_refuse_an_unknown_fault_kind() -> None:
    with pytest.raises(ValueError, match="unknown fault kind 'sigstop_all'"):
        ChaosOptions(faults=("kill_producer", "sigstop_all"))


def test_options_refuse_an_unknown_transport() -> None:
    with pytest.raises(ValueError, match="ucx_tls must be one of cma, tcp, got 'rdma'"):
        ChaosOptions(ucx_tls="rdma")


def test_namespaces_need_tcp_reads() -> None:
    with pytest.raises(ValueError, match="needs ucx_tls 'tcp'"):
        ChaosOptions(netns=True)
    assert ChaosOptions(netns=True, ucx_tls="tcp").netns


def test_mid_read_faults_need_items_as_large_as_the_reads_they_wait_for() -> None:
    with pytest.raises(ValueError, match="has no item that large"):
        ChaosOptions(working_set="64KiB:10,1MiB:2", faults=("readd_peer",))
    # Without those kinds a small working set is fine, and so is a smaller threshold.
    ChaosOptions(working_set="64KiB:10,1MiB:2", faults=("kill_producer",))
    ChaosOptions(working_set="64KiB:10,1MiB:2", large_read_bytes=1 << 20)


def test_command_line_names_the_transports_for_a_bad_ucx_tls() -> None:
    done = _chaos("--ucx-tls", "rdma")
    assert done.returncode == 2
    assert "unknown UCX transport 'rdma': choose from cma, tcp" in done.stderr


def test_command_line_names_the_kinds_for_an_unknown_fault() -> None:
    done = _chaos("--faults", "kill_producer,freeze_everything")
    assert done.returncode == 2
    assert "unknown fault kind 'freeze_everything'" in done.stderr
    assert "freeze_producer_mid_read" in done.stderr  # the choices are listed


def test_command_line_refuses_netns_over_cma_before_starting_anything() -> None:
    done = _chaos("--netns", "--fetches", "10")
    assert done.returncode == 2
    assert "--netns" in done.stderr and "--ucx-tls tcp" in done.stderr
    assert done.stdout == ""


def test_command_line_refuses_a_working_set_without_large_items() -> None:
    done = _chaos("--working-set", "64KiB:8", "--faults", "partition_control")
    assert done.returncode == 2
    assert "--large-read" in done.stderr and "no item that large" in done.stderr


def test_command_line_refuses_netem_with_netns() -> None:
    done = _chaos("--netns", "--ucx-tls", "tcp", "--netem", "delay 5ms")
    assert done.returncode == 2
    assert "cannot be combined" in done.stderr


def test_push_faults_need_push_traffic() -> None:
    assert not set(PUSH_KINDS) & set(FAULT_KINDS)
    with pytest.raises(ValueError, match="strikes push traffic, and this run pushes nothing"):
        ChaosOptions(faults=("kill_producer_mid_push",))
    with pytest.raises(ValueError, match="push is a share of fetch batches, 0 to 1"):
        ChaosOptions(push=1.5)
    assert ChaosOptions(push=0.3, faults=PUSH_KINDS).push == 0.3


def test_command_line_refuses_push_faults_without_push_and_a_bad_share() -> None:
    done = _chaos("--faults", "fill_consumer_region", "--fetches", "10")
    assert done.returncode == 2
    assert "--push SHARE" in done.stderr and done.stdout == ""
    done = _chaos("--push", "2")
    assert done.returncode == 2
    assert "a share of fetch batches, 0 to 1, got 2" in done.stderr
