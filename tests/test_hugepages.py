"""`mtjax train` runs with glibc's transparent-huge-page tunable (mtjax/hugepages.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mtjax import cli, hugepages


@pytest.fixture
def glibc_2_36(monkeypatch):
    monkeypatch.setattr(hugepages.platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(hugepages.sys, "platform", "linux")


def test_environment_adds_the_tunable_once(glibc_2_36):
    assert hugepages.environment({"HOME": "/h"}) == {"HOME": "/h", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert hugepages.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert hugepages.environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None  # the user's choice stands
    assert hugepages.environment({"MTJAX_HUGE_PAGES": "0"}) is None


@pytest.mark.parametrize("libc", [("glibc", "2.31"), ("", ""), ("musl", "1.2")])
def test_environment_leaves_other_libcs_alone(monkeypatch, libc):
    monkeypatch.setattr(hugepages.platform, "libc_ver", lambda: libc)
    assert hugepages.environment({}) is None


def test_reexec_runs_the_command_again_with_the_tunable():
    if hugepages.environment({}) is None:
        pytest.skip("this libc has no glibc.malloc.hugetlb tunable")
    code = "import os; from mtjax import hugepages; print('run'); hugepages.reexec(); print(os.environ['GLIBC_TUNABLES'])"
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MTJAX_HUGE_PAGES")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    # The first run stops at the exec; the second finds the tunable set and goes on.
    assert out.split() == ["run", "run", "glibc.malloc.hugetlb=1"]


@pytest.mark.parametrize("argv,reexecs", [(["train", "--print-config"], 1), (["plan", "--help"], 0)])
def test_only_train_from_the_command_line_reexecs(monkeypatch, capsys, argv, reexecs):
    calls = []
    monkeypatch.setattr(hugepages, "reexec", lambda: calls.append(1))
    monkeypatch.setattr(sys, "argv", ["mtjax", *argv])
    try:
        cli.main()
    except SystemExit:  # --help
        pass
    assert len(calls) == reexecs
    assert cli.main(["train", "--print-config"]) == 0  # called from Python: that process stays as it is
    assert len(calls) == reexecs
