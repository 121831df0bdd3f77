"""A task process that ends at once, for tests of how task processes are started and waited for: a
module of its own, so that each forked child imports nothing heavy to find it."""

import os


def quick_task(component_code, executor_args, env, output, usage) -> None:
    """The shape of task_processes._run_executor's arguments; sends no usage (the parent reads none)."""
    output.close()
    usage.close()
    os._exit(0)
