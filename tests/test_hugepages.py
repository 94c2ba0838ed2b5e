"""mtjax.hugepages: the `mtjax` process runs with glibc's malloc asking for huge pages."""

import os
import platform
import subprocess
import sys

import pytest

from mtjax import hugepages


def test_environment_adds_the_tunable_only_where_it_changes_something():
    env = hugepages.environment({"A": "1"}, "madvise", "glibc")
    assert env == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    kept = hugepages.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", "glibc")
    assert kept["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert hugepages.environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", "glibc") is None
    assert hugepages.environment({}, "always", "glibc") is None  # every big mapping gets them already
    assert hugepages.environment({}, "never", "glibc") is None
    assert hugepages.environment({}, None, "glibc") is None
    assert hugepages.environment({}, "madvise", "") is None  # not glibc: not its tunable


def test_thp_mode_reads_the_selected_word(tmp_path):
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert hugepages.thp_mode(str(tmp_path / "enabled")) == "madvise"
    assert hugepages.thp_mode(str(tmp_path / "missing")) is None


# malloc itself, as XLA's CPU client calls it (numpy asks for huge pages for its own big arrays).
CHILD = """
import ctypes, resource, sys
from mtjax import hugepages
hugepages.restart()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(64 << 20)  # over glibc's mmap threshold: a mapping of its own
ctypes.memset(block, 1, 64 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, sys.argv[1:])
"""


@pytest.mark.skipif(hugepages.thp_mode() != "madvise" or platform.libc_ver()[0] != "glibc",
                    reason="huge pages on request need glibc and transparent_hugepage 'madvise'")
def test_restarted_process_faults_big_buffers_in_by_huge_pages():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", CHILD, "x", "--y"], env=env, capture_output=True, text=True,
                         check=True).stdout.split(maxsplit=1)
    # 4 KiB pages: 16384 faults; huge pages: 32 and the few small pages around them.
    assert int(out[0]) < 4096, out
    assert out[1].strip() == "['x', '--y']"  # the same command line, run again
