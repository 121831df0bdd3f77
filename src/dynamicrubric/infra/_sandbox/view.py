"""The launcher's filesystem work: its namespaces, the read-only view, and each run's writable tmpfs.

The launcher first unshares what the kernel allows (`enter_namespaces`) and builds the view that the
judge and every run see (`build_view`); each run's supervisor then mounts the run's own tmpfs over it
in a mount namespace of its own (`mount_scratch`). Standard library only (see `__main__.py`).
"""

from __future__ import annotations

import glob
import os

from .common import (
    CLONE_NEWIPC,
    CLONE_NEWNET,
    CLONE_NEWNS,
    CLONE_NEWUSER,
    DEVICES,
    MS_BIND,
    MS_NOATIME,
    MS_NODEV,
    MS_NODIRATIME,
    MS_NOEXEC,
    MS_NOSUID,
    MS_PRIVATE,
    MS_RDONLY,
    MS_REC,
    MS_RELATIME,
    MS_REMOUNT,
    SCRATCH,
    check,
    libc_call,
    mount,
)


def enter_namespaces(isolation: dict) -> None:
    """Unshare what the kernel allows (the PID namespace comes later, for the code only)."""
    if os.geteuid() != 0:
        uid, gid = os.getuid(), os.getgid()
        err = libc_call("unshare", CLONE_NEWUSER)
        if err:
            isolation["notes"].append(f"no user namespace ({err}); no namespace can be made")
            return
        # Map only our own ids, so files the code creates belong to the caller as before.
        for path, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{path}", "w") as f:
                f.write(text)
        isolation["userns"] = True
    for name, flag in (("mountns", CLONE_NEWNS), ("netns", CLONE_NEWNET), ("ipcns", CLONE_NEWIPC)):
        err = libc_call("unshare", flag)
        if err:
            isolation["notes"].append(f"no {name} ({err})")
        else:
            isolation[name] = True


def _bind_read_only(source: str, target: str) -> None:
    """Bind `source` at `target` read-only, keeping the flags a user namespace may not clear."""
    mount(source, target, None, MS_BIND | MS_REC)
    st = os.statvfs(source).f_flag
    kept = 0
    for st_flag, ms_flag in (
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    ):
        if st & st_flag:
            kept |= ms_flag
    mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept)


def build_view(config: dict) -> None:
    """The read-only part of the code's filesystem (see sandbox.py), mounted under base/root in this
    namespace. Each run adds its own writable tmpfs in a namespace of its own (`mount_scratch`)."""
    root = f"{config['base']}/root"
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates to the host
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    done: list[str] = []
    for path in config["exposed"]:
        if any(path == d or path.startswith(d + "/") for d in done):
            continue  # already inside a recursive bind
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)  # e.g. /bin -> usr/bin, resolved inside the view
        elif os.path.isdir(path):
            if os.path.realpath(path) == "/":
                raise OSError("refusing to show the host's whole filesystem in the view")
            os.makedirs(target, exist_ok=True)
            _bind_read_only(path, target)
            done.append(path)
        elif os.path.isfile(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
            _bind_read_only(path, target)
    for pattern in config["hidden"]:
        for path in glob.glob(pattern):
            if any(path.startswith(d + "/") for d in done) and os.path.isdir(root + path):
                mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")

    dev = f"{root}/dev"
    os.mkdir(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for name in DEVICES:
        open(f"{dev}/{name}", "w").close()
        mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, f"{dev}/{name}")
    os.symlink("/proc/self/fd/1", f"{dev}/stdout")
    os.symlink("/proc/self/fd/2", f"{dev}/stderr")
    for inside in SCRATCH.values():
        os.makedirs(root + inside, exist_ok=True)
    os.mkdir(f"{root}/proc")  # mounted by each run's init, inside its PID namespace
    mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def mount_scratch(config: dict, run: int) -> None:
    """One run's writable storage, in a mount namespace of the run's own: a size-capped tmpfs (the disk
    quota, shared by its four uses) bound at the working directory, /tmp, /var/tmp and /dev/shm."""
    check(libc_call("unshare", CLONE_NEWNS))
    base = config["base"]
    scratch = f"{base}/scratch-{run}"
    os.mkdir(scratch, 0o700)
    mount(
        "tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={config['disk_mb']}m,nr_inodes=16k,mode=755"
    )
    for name in SCRATCH:
        os.mkdir(f"{scratch}/{name}", 0o700 if name == "work" else 0o1777)
        os.chmod(f"{scratch}/{name}", 0o700 if name == "work" else 0o1777)  # mkdir applies the umask
    write_code(f"{scratch}/work", config["codes"][run], config["host_ids"])
    for name, inside in SCRATCH.items():
        mount(f"{scratch}/{name}", f"{base}/root{inside}", None, MS_BIND)


def write_code(folder: str, code: str, owner: list[int]) -> None:
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = f"{folder}/main.py"
    with open(path, "w", encoding="utf-8") as f:
        f.write(code)
    for p in (folder, path):
        os.chown(p, owner[0], owner[1])
