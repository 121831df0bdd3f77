"""Run a command under a memory limit, as a pod's `resources.limits.memory` holds it: over the limit the
process is killed (exit 137, as the kubelet's OOM kill reads), not slowed down.

`run_with_memory_limit` puts the child in a memory cgroup of its own before it runs a single instruction
of the command (the pid is written to `cgroup.procs` between fork and exec), so everything it and its
children allocate counts. The cgroup v1 memory controller (/sys/fs/cgroup/memory, writable as root) is
used where mounted, cgroup v2's `memory.max` where the unified hierarchy has the memory controller, else
`RLIMIT_AS` (address space, not resident memory: a looser stand-in, and going over raises MemoryError in
Python instead of a kill). `memory_limit_mechanism()` says which one works here (None: none does, skip).

Page cache counts towards a cgroup's limit but is reclaimed before anything is killed, so writing a file
larger than the limit is fine; a tmpfs file (shared memory) is not reclaimable and does count.

A disk limit (a pod's `ephemeral-storage` limit, an emptyDir's `sizeLimit`) is held as the kubelet holds
it: `DiskWatcher` polls the disk use of the folder that stands for the pod's writable storage and evicts
the pod (kills its processes) once it is over; `run_with_disk_limit` runs a command so.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")


def _v1_parent() -> Path | None:
    """This process's own v1 memory group (a child of it is nested under its limits), else the root."""
    if not (CGROUP_V1 / "cgroup.procs").is_file():
        return None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                own = CGROUP_V1 / path.lstrip("/")
                if os.access(own, os.W_OK):
                    return own
    return CGROUP_V1 if os.access(CGROUP_V1, os.W_OK) else None


def _v2_parent() -> Path | None:
    controllers = CGROUP_V2 / "cgroup.controllers"
    if not controllers.is_file() or "memory" not in controllers.read_text().split():
        return None
    with contextlib.suppress(OSError):
        path = Path("/proc/self/cgroup").read_text().strip().splitlines()[-1].split("::", 1)[1]
        own = CGROUP_V2 / path.lstrip("/")
        # A v2 group with processes in it cannot have children with controllers ("no internal
        # processes"): use its parent's subtree where ours is not usable.
        for parent in (own.parent, CGROUP_V2):
            if "memory" in (parent / "cgroup.subtree_control").read_text().split() and os.access(
                parent, os.W_OK
            ):
                return parent
    return None


@functools.cache
def memory_limit_mechanism() -> str | None:
    """ "cgroup-v1", "cgroup-v2" or "rlimit-as": the way this machine can hold a process to a memory
    limit (checked by making and removing a group); None when none works."""
    for name, parent, limit_file in (
        ("cgroup-v1", _v1_parent(), "memory.limit_in_bytes"),
        ("cgroup-v2", _v2_parent(), "memory.max"),
    ):
        if parent is None:
            continue
        probe = parent / f"pod-limits-probe-{uuid.uuid4().hex[:8]}"
        try:
            probe.mkdir()
            try:
                (probe / limit_file).write_text(str(64 << 20))
                return name
            finally:
                probe.rmdir()
        except OSError:
            continue
    try:
        resource.getrlimit(resource.RLIMIT_AS)
        return "rlimit-as"
    except (OSError, ValueError):
        return None


def v1_memory_group(name: str, limit_bytes: int) -> Path:
    """A new cgroup v1 memory group `name` (under this process's own) that holds the processes put in
    it to `limit_bytes`, as a pod's memory limit does; the pod stand-ins' groups are made here."""
    parent = _v1_parent()
    if parent is None:
        raise RuntimeError("no writable cgroup v1 memory controller here")
    group = parent / name
    group.mkdir()
    (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    with contextlib.suppress(OSError):  # swap would let it exceed the limit unseen (absent without swap)
        (group / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
    return group


def remove_group(group: Path) -> None:
    """rmdir a memory group once its last process has been reaped (a killed one's may take a moment)."""
    for _ in range(50):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: a process of it still exits
            time.sleep(0.1)


def run_with_memory_limit(
    cmd: Sequence[str], limit_bytes: int, *, timeout: float = 300, **popen_kwargs: Any
) -> subprocess.CompletedProcess:
    """Run `cmd` to completion with at most `limit_bytes` of memory for it and its children; returns
    the completed process (`returncode` 137 when the cgroup's OOM killer stopped it). Extra keyword
    arguments go to `subprocess.run` (`capture_output`, `text`, `env`, `cwd`)."""
    mechanism = memory_limit_mechanism()
    if mechanism is None:
        raise RuntimeError(
            "no way to limit a process's memory here (no writable memory cgroup, no RLIMIT_AS)"
        )
    if mechanism == "rlimit-as":

        def limit_address_space() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

        return subprocess.run(list(cmd), timeout=timeout, preexec_fn=limit_address_space, **popen_kwargs)
    name = f"pod-limits-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if mechanism == "cgroup-v1":
        group = v1_memory_group(name, limit_bytes)
    else:
        parent = _v2_parent()
        assert parent is not None
        group = parent / name
        group.mkdir()
    try:
        if mechanism == "cgroup-v2":
            (group / "memory.max").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):
                (group / "memory.swap.max").write_text("0")
        procs = str(group / "cgroup.procs")

        def join_group() -> None:  # in the child, after fork and before exec: all of the command counts
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        proc = subprocess.run(list(cmd), timeout=timeout, preexec_fn=join_group, **popen_kwargs)
        if proc.returncode == -9:
            proc.returncode = 137  # as a shell (and the kubelet) reports a SIGKILL
        return proc
    finally:
        remove_group(group)


class DiskWatcher:
    """The kubelet's check of a pod's local storage: the disk use of `folder` every 0.2 s (the kubelet
    looks every 10 s or so: this is stricter), its peak in `record[peak]`; over `limit` bytes the pod is
    evicted (`evict()`), and `record["evicted"]` says why."""

    def __init__(self, folder: Path, limit: int, record: dict, evict: Callable[[], None], *,
                 what: str, limit_name: str, peak: str):  # fmt: skip
        self.folder, self.limit, self.record, self.evict = folder, limit, record, evict
        self.what, self.limit_name, self.peak = what, limit_name, peak
        self.record[peak] = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            used = disk_use(self.folder)
            self.record[self.peak] = max(self.record[self.peak], used)
            if used > self.limit:
                self.record["evicted"] = f"{self.what} {used} B over its {self.limit_name} {self.limit} B"
                self.evict()
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        if not self.record.get("evicted"):
            self.record[self.peak] = max(self.record[self.peak], disk_use(self.folder))


def disk_use(folder: Path) -> int:
    """Bytes of disk the files under `folder` take (as `du` counts them); files vanishing meanwhile are
    skipped."""
    total = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def run_with_disk_limit(
    cmd: Sequence[str], folder: Path, limit_bytes: int, *, timeout: float = 300, **popen_kwargs: Any
) -> tuple[subprocess.CompletedProcess, dict]:
    """Run `cmd` as a pod whose writable storage is `folder` (its files, its TMPDIR, its mounts: the caller
    points them there) with an ephemeral-storage limit of `limit_bytes`: over it, the command and its
    children are killed (exit 137) as the kubelet evicts the pod. Returns the completed process (output
    as text) and the record: the peak disk use ("disk_peak"), and why it was evicted ("evicted")."""
    record: dict = {}
    proc = subprocess.Popen(list(cmd), start_new_session=True, text=True, **popen_kwargs)

    def evict() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    watcher = DiskWatcher(folder, limit_bytes, record, evict, what="the pod's local storage",
                          limit_name="ephemeral-storage limit", peak="disk_peak")  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        watcher.stop()
        evict()  # a pod's end leaves no process of it behind
        proc.wait()
    code = 137 if proc.returncode == -9 else proc.returncode
    return subprocess.CompletedProcess(list(cmd), code, out, err), record
