"""Where a training rank waits for another rank's work that is not a collective of the accelerators.

Some waits are long and are not the accelerators' work: the ranks uploading a ~92 GiB trainer checkpoint, a
node's first process downloading it on resume, rank 0 exporting the model, or rank 0 (on several nodes,
each node's first process) asking the served reward models (G and V behind `vllm serve`) for a step's
scores while the others wait for them.
Left in the accelerator process group (NCCL on GPUs), such a wait is ended by that group's watchdog
(`train_*.process_group_timeout_s`) while the work goes on; the reward's own bound (its ledger's
`serving.deadline_s`) would never get to act. So those waits happen here, on a gloo group of their own,
with `train_*.wait_timeout_s`. A rank that dies ends them at once (its connections close), so the long
timeout only bounds work that is still going on.

`init` must run on every rank, once, right after the process group exists (it creates a group: every rank
in the same order); without a process group, or with one process, both waits return at once.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

_group = None  # the gloo group of this process's training job, once `init` made it


def init(timeout: timedelta) -> None:
    """Create the waits' gloo group of this job (every rank calls this once, in the same order)."""
    global _group
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _group = dist.new_group(backend="gloo", timeout=timeout)


def _waits_group():
    """The group, None for one process; an error where several run but `init` never ran (a wait on the
    accelerator group instead would be the very bug this module is for)."""
    import torch.distributed as dist

    if _group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("cpu_waits.init() was not called after the process group was created")
    return _group


def barrier() -> None:
    """Every rank waits here until all have come (one has finished its transfer)."""
    import torch.distributed as dist

    if (group := _waits_group()) is not None:
        dist.barrier(group=group)


def gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank (a pickled all-gather over gloo)."""
    import torch.distributed as dist

    if (group := _waits_group()) is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(out, obj, group=group)
    return out
