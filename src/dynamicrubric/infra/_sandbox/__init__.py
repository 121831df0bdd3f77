"""The parts of the sandbox that run outside the caller's process: standard library only.

- The launcher (`__main__.py`, then `launcher.py`, `view.py`, `runs.py`, `seccomp.py`, `common.py`):
  `sandbox_launch.py` starts it as `python -I -S <this folder>/__main__.py` for every batch of runs. It
  makes the namespaces and the read-only view, then starts the judge and each run's code. `__main__.py`
  says how it finds the other files without widening its import path.
- The judge and the worker (`child.py`): its source is passed to `python -I -S -c` inside the view,
  where this package is not installed.

`dynamicrubric.infra.sandbox` imports only constants from here (`common.py`), and the tests import the
child's encoder; in the launcher process this `__init__.py` is never run (see `__main__.py`), so it must
stay free of code. The module docstring of `sandbox.py` says what each step of a run is for.
"""
