"""The launcher process's entry point. `sandbox_launch.py` runs this file as
`python -I -S <package>/_sandbox/__main__.py`, in a new session, with the run's config as JSON on
stdin; it then runs `launcher.launch()`.

How the launcher's other files are found, and why this way:
- `-I` (isolated mode) keeps the caller's environment, site-packages and the script's own folder off
  sys.path, and `-S` skips `site`: the launcher imports nothing but the standard library. That must
  stay so, yet a script cannot import the files next to it under `-I`.
- `python -m dynamicrubric.infra._sandbox.launcher` would need the folder that holds the whole package
  (site-packages, or src/) on sys.path: everything installed there, which `-I` is there to leave out.
- Running the folder (`python -I -S <folder>`) works, as Python puts a folder or zip it runs at
  sys.path[0] even under `-I` (checked on 3.11); so does inserting this folder into sys.path. Both make
  the launcher's file names top-level modules that come before the standard library: a file named like
  a standard module would shadow it for the launcher and for every module it imports.
- So this file registers its own folder as a package, `_sandbox`, whose `__path__` is that folder only,
  and the launcher's modules import each other relatively (`from .common import ...`), exactly as they
  do when imported in-process as `dynamicrubric.infra._sandbox`. sys.path is left as `-I -S` makes it for a
  script: the standard library only. What the launcher can import grows by this folder's own files,
  and only under `_sandbox.`, where they can shadow nothing. They load through `__pycache__` like the
  caller's own modules (which the caller already trusts), so the launcher starts faster than the one
  file it was, which was compiled on every start.
The code and the judge never see any of it: they are started afresh with `python -I -S -c`, inside a
view without this package (see sandbox.py). The package's `__init__.py` is not run here.
"""

import os
import sys
from types import ModuleType

PACKAGE = "_sandbox"  # the launcher's name for this folder; not importable by any other name here


def main() -> int:
    package = ModuleType(PACKAGE)
    package.__path__ = [os.path.dirname(os.path.abspath(__file__))]
    sys.modules[PACKAGE] = package
    from _sandbox.launcher import launch  # only now can the package's modules be found

    return launch()


if __name__ == "__main__":
    sys.exit(main())
