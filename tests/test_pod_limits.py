"""The memory limit of `pod_limits.run_with_memory_limit` holds: over it the command is killed as a pod
is OOM-killed, under it the command runs."""

from __future__ import annotations

import sys

import pytest
from pod_limits import memory_limit_mechanism, run_with_memory_limit


def test_a_command_over_its_memory_limit_is_killed_and_one_under_it_runs():
    mechanism = memory_limit_mechanism()
    if mechanism is None:
        pytest.skip("no memory cgroup (v1 or v2) is writable here and RLIMIT_AS is unavailable")
    grab = "x = bytearray({} << 20); x[::4096] = b'1' * len(x[::4096])"  # touch every page
    over = run_with_memory_limit([sys.executable, "-c", grab.format(300)], 150 << 20, capture_output=True)
    # A cgroup kills (137); RLIMIT_AS refuses the allocation (MemoryError, exit 1).
    assert over.returncode == (1 if mechanism == "rlimit-as" else 137), over
    under = run_with_memory_limit([sys.executable, "-c", grab.format(20)], 150 << 20, capture_output=True)
    assert under.returncode == 0, under.stderr
