"""The launcher: one process per batch of runs, started by `sandbox_launch.py` (through `__main__.py`).

`launch()` reads the config on stdin, makes the namespaces and the view, reports the isolation in force
(or refuses), starts the judge and a supervisor per run, and reports each run's verdict or exit status
on the report pipe as it comes, then `done`. Standard library only, and few imports: it starts for
every batch. The module docstring of `sandbox.py` says what each step is for.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal

from .common import (
    ALLOW_WEAK_ENV,
    CGROUP_PREFIX,
    CLONE_NEWPID,
    CLONE_NEWUSER,
    PR_SET_DUMPABLE,
    check,
    libc_call,
    write,
)
from .runs import exec_judge, supervise
from .seccomp import seccomp_program
from .view import build_view, enter_namespaces, write_code


def _read_all(fd: int) -> bytes:
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    os.close(fd)
    return data


def _lines(fd: int):
    """JSON objects, one a line, as they arrive; ends at EOF."""
    buffer = b""
    while chunk := os.read(fd, 65536):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            with contextlib.suppress(json.JSONDecodeError):
                yield json.loads(line)
    os.close(fd)


def _allowed(flag: int) -> bool:
    """Whether a namespace of this kind can be made here (asked in a throwaway child)."""
    child = os.fork()
    if child == 0:
        os._exit(1 if libc_call("unshare", flag) else 0)
    _, status = os.waitpid(child, 0)
    return os.waitstatus_to_exitcode(status) == 0


def _memory_cgroups(config: dict) -> list[str]:
    """One memory cgroup per run, limited to the run's memory: the cap is on all of its processes (and
    the files it writes to its tmpfs) together. Made next to our own cgroup's children (cgroup v2 or
    the v1 memory hierarchy); [] where none can be made (no cgroup we may write to)."""
    with open("/proc/self/cgroup") as f:
        own = dict(line.rstrip("\n").split(":", 2)[1:] for line in f if line.count(":") >= 2)
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    candidates = []
    for fields in mounts:
        fstype, options = fields[-3], fields[-1].split(",")
        key = "" if fstype == "cgroup2" else "memory" if fstype == "cgroup" and "memory" in options else None
        if key is None or key not in own:
            continue
        root, path = fields[3], own[key]  # a mount of a sub-tree (in a container) shows it from its root
        if root != "/" and path.startswith(root):
            path = path[len(root) :]
        files = (
            ("memory.max", "memory.swap.max")
            if key == ""
            else ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        )
        candidates.append((fields[4] + path, *files))
    name = CGROUP_PREFIX + os.path.basename(config["base"])
    for folder, limit_file, swap_file in candidates:
        # In cgroup v2 a cgroup with processes (ours) cannot pass controllers to children: try its parent.
        for parent in (folder.rstrip("/"), os.path.dirname(folder.rstrip("/"))):
            made = []
            try:
                v2 = limit_file == "memory.max"
                for run in range(len(config["codes"])):
                    path = f"{parent}/{name}-{run}"
                    os.mkdir(path, 0o700)
                    made.append(path)
                    write(f"{path}/{limit_file}", str(config["limits"]["run_memory"]))
                    with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                        write(f"{path}/{swap_file}", "0" if v2 else str(config["limits"]["run_memory"]))
                    with contextlib.suppress(OSError):  # v2: an out-of-memory kill ends the whole run
                        write(f"{path}/memory.oom.group", "1")
                return made
            except OSError:
                for path in made:
                    with contextlib.suppress(OSError):
                        os.rmdir(path)
    return []


def _oom_killed(cgroup: str) -> bool:
    """Whether the kernel killed a process of the run for exceeding the run's memory."""
    for name in ("memory.events", "memory.oom_control"):  # cgroup v2, v1
        with contextlib.suppress(OSError), open(f"{cgroup}/{name}") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill" and int(value) > 0:
                    return True
    return False


def _refusal(isolation: dict) -> str:
    missing = [n for n in ("mountns", "view", "netns", "pidns", "runuserns") if not isolation.get(n)]
    return (
        f"sandbox: no isolated run is possible here (missing: {', '.join(missing)}; "
        f"{'; '.join(isolation['notes'])}). Run as root or where user namespaces are allowed, or in a "
        f"gVisor pod (manifests/cluster/gvisor), and set {ALLOW_WEAK_ENV}=1 to accept the weaker fallback there."
    )


def launch() -> int:
    config = json.loads(_read_all(0))  # the parent writes it to our stdin; it holds the tests
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)  # what the code inherits as stdin
    os.close(null)
    report_fd = config["report_fd"]
    os.set_inheritable(report_fd, False)  # the code must not be able to forge the report

    def report(item: dict) -> None:
        os.write(report_fd, json.dumps(item).encode() + b"\n")

    isolation = {"user": config["user_name"], "notes": []}
    isolation.update(
        dict.fromkeys(("userns", "mountns", "view", "netns", "pidns", "ipcns", "runuserns", "memcap"), False)
    )
    config["isolation"] = isolation
    config["seccomp"] = seccomp_program(os.uname().machine)
    isolation["seccomp"] = config["seccomp"] is not None
    if not isolation["seccomp"]:
        isolation["notes"].append(f"no seccomp filter for the {os.uname().machine} architecture")
    if config["namespaces"]:
        enter_namespaces(isolation)
        if isolation["mountns"]:
            try:
                build_view(config)
                isolation["view"] = True
            except OSError as e:
                isolation["notes"].append(f"no read-only view ({e}); the host filesystem is visible")
        isolation["pidns"] = _allowed(CLONE_NEWPID)
        if not isolation["pidns"]:
            isolation["notes"].append(
                "no pidns (unshare failed); stray processes are found by session and folder"
            )
        isolation["runuserns"] = _allowed(CLONE_NEWUSER)
        if not isolation["runuserns"]:
            isolation["notes"].append("no user namespace per run (unshare failed)")
    else:
        isolation["notes"].append("namespaces disabled by the caller; using the fallback guards")
    complete = all(isolation[n] for n in ("mountns", "view", "netns", "pidns", "runuserns"))
    config["cgroups"] = _memory_cgroups(config) if complete else []
    isolation["memcap"] = bool(config["cgroups"])
    if complete and not isolation["memcap"]:
        isolation["notes"].append("no memory cgroup to write to: memory is capped per process only")
    if not complete and config["allow_weak"]:
        isolation["notes"].append(f"running with weak isolation ({ALLOW_WEAK_ENV} or allow_weak)")
    report({"isolation": isolation, "cgroups": config["cgroups"]})  # the parent removes them
    if not complete and not config["allow_weak"]:
        report({"refused": _refusal(isolation)})
        return 0
    runs, job, base = len(config["codes"]), config["job"], config["base"]
    owner = config["user"] or [os.getuid(), os.getgid()]
    if not isolation["view"]:
        for run, code in enumerate(config["codes"]):
            write_code(f"{base}/work-{run}", code, owner)
    # Same-user processes (the fallback) can then neither ptrace this process nor read its memory.
    check(libc_call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0))

    error_r, error_w = os.pipe()  # setup errors; EOF once every child has exec'd (close-on-exec)
    status_r, status_w = os.pipe()  # the runs' exit statuses, from their inits
    code_fds = []
    for run in range(runs):  # stdout, stderr: files the parent reads; the code writes its end only
        out, err = (
            os.open(f"{base}/{n}-{run}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600) for n in ("out", "err")
        )
        code_fds.append({1: out, 2: err})
    judge_pid, launcher_ends = None, []
    if job is not None:
        job_r, job_w = os.pipe()
        verdict_r, verdict_w = os.pipe()
        judge_fds = {0: job_r, 3: verdict_w}
        for run in range(runs):  # the judge's calls to run i go out on fd 4+2i, answers come on 5+2i
            req_r, req_w = os.pipe()
            rep_r, rep_w = os.pipe()
            judge_fds.update({4 + 2 * run: req_w, 5 + 2 * run: rep_r})
            code_fds[run].update({3: req_r, 4: rep_w})
        judge_pid = os.fork()  # in the launcher's PID namespace: no run's code can see or signal it
        if judge_pid == 0:
            exec_judge(config, error_w, judge_fds)
        for fd in judge_fds.values():
            os.close(fd)
        launcher_ends = [job_w, verdict_r]
    supervisors = {}
    for run in range(runs):
        pid = os.fork()
        if pid == 0:
            for other, fds in enumerate(code_fds):  # another run's ends must not reach this run's code
                if other != run:
                    for fd in fds.values():
                        os.close(fd)
            for fd in (error_r, status_r, *launcher_ends):
                os.close(fd)
            supervise(config, run, error_w, status_w, code_fds[run])
        supervisors[run] = pid
    for fds in code_fds:
        for fd in fds.values():
            os.close(fd)
    os.close(error_w)
    os.close(status_w)

    if job is not None:
        with contextlib.suppress(BrokenPipeError):  # a judge that died early is reported below
            os.write(launcher_ends[0], json.dumps({**job, "runs": runs}).encode())
        os.close(launcher_ends[0])
    setup_error = _read_all(error_r).decode(errors="replace")
    if setup_error:
        report({"setup_error": setup_error})
    if job is not None:
        for verdict in _lines(launcher_ends[1]):  # one a line, as the judge decides them
            run = verdict.get("run")
            if run in supervisors:
                if config["cgroups"] and _oom_killed(config["cgroups"][run]):  # even if it answered
                    error = f"the run exceeded its memory cap\n{verdict.get('error') or ''}"
                    verdict = {**verdict, "passed": False, "error": error}
                report({"verdict": verdict})
                # That run is decided: end it now, so it takes no CPU from the runs still being judged.
                os.kill(supervisors[run], signal.SIGKILL)
        for pid in supervisors.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.waitpid(judge_pid, 0)
    for status in _lines(status_r):
        if config["cgroups"]:
            status["oom"] = _oom_killed(config["cgroups"][status["run"]])
        report({"status": status})
    for pid in supervisors.values():
        os.waitpid(pid, 0)
    report({"done": True})
    return 0
