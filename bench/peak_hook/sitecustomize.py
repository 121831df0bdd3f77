"""Peak memory of the training processes that bench/gpu_full.py launches through the project's launcher.

The launch is the production path (`accelerate launch -m dynamicrubric.training.process`): nothing in the
command says to measure, and the process ends with `os._exit` (no atexit). So bench/gpu_full.py puts this
folder first on PYTHONPATH, and Python imports this file at start-up in every process of the launch. With
DYNRUBRIC_BENCH_PEAK_DIR set it acts only in torchrun's workers (LOCAL_RANK set): a daemon thread reads,
every POLL_S, torch's peak GPU memory of the worker's device (allocated and reserved, by the caching
allocator's own counters, so no transient is missed between polls; nothing in the training path resets
them: the Trainer's memory metrics are off by default) and the process's peak RSS, and rewrites
`<dir>/peak-rank<RANK>.json` whenever a number grew. The last file written holds the peaks up to at most
POLL_S before the process ended; gpu_full.py waits longer than that after the step before it stops the
launch. Without the variable, or in the launcher's own processes, it does nothing but pass on to the
sitecustomize it shadows, if there is one.
"""

from __future__ import annotations

import importlib
import os
import sys

POLL_S = 0.2
GIB = 1024**3


def _chain() -> None:
    """Import the sitecustomize this one shadows (a distribution's own, e.g. Debian's), as Python would
    have without this folder on the path."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved, module = list(sys.path), sys.modules.pop("sitecustomize", None)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if module is not None:
            sys.modules["sitecustomize"] = module


def _watch(folder: str, rank: str, local_rank: int) -> None:
    import json
    import resource
    import time

    path = os.path.join(folder, f"peak-rank{rank}.json")
    seen: dict[str, float] = {}
    while True:
        now = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}
        torch = sys.modules.get("torch")  # never imported here first: the main thread's import owns it
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and cuda.is_initialized():
            now["peak_allocated_gib"] = cuda.max_memory_allocated(local_rank) / GIB
            now["peak_reserved_gib"] = cuda.max_memory_reserved(local_rank) / GIB
        grown = {k: max(v, seen.get(k, 0.0)) for k, v in now.items()}
        if grown != seen:
            seen = grown
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump({**seen, "pid": os.getpid(), "rank": int(rank), "device_index": local_rank}, f)
            os.replace(tmp, path)  # a reader sees a whole file, never a half-written one
        time.sleep(POLL_S)


def _start() -> None:
    folder = os.environ.get("DYNRUBRIC_BENCH_PEAK_DIR")
    if not folder or os.environ.get("LOCAL_RANK") is None:
        return
    import threading

    os.makedirs(folder, exist_ok=True)
    args = (folder, os.environ.get("RANK", "0"), int(os.environ["LOCAL_RANK"]))
    threading.Thread(target=_watch, args=args, name="bench-peak-memory", daemon=True).start()


# Once a process: should the shadowed sitecustomize be found in this folder after all (a path spelled two ways),
# importing it again must not start over.
if not getattr(sys, "_bench_peak_hook", False):
    sys._bench_peak_hook = True
    _chain()
    _start()
