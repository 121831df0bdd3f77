"""What every node of a training TrainJob runs: `python -m dynamicrubric.training.node --config URI --job
URI --result URI` (training/trainjob.py builds that command).

The node reads the run's config and the job from the store, takes its rank and rank 0's address from
the torch runtime's PET_* variables (`launcher.Rendezvous`), and runs the same `launcher.run_node` as a
one-node task: its own reward servers on its share of `reward_gpus`, then `accelerate launch` of its
world_size / num_nodes processes over all nodes. Whether the processes use CUDA is this machine's to
say, not the submitting task's. A TrainJob whose node count differs from the config's is refused
before anything starts; the processes also refuse a world size other than the configured one
(training/grpo.py), so no rank trains at a size it was not configured for.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from dynamicrubric import store
from dynamicrubric.infra import logs
from dynamicrubric.infra.config_loading import config_from_yaml
from dynamicrubric.training.checkpoints import work_prefix
from dynamicrubric.training.data import TrainingJob, trainee
from dynamicrubric.training.launcher import Rendezvous, TrainingError, run_node


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dynamicrubric.training.node", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", required=True, help="the run's YAML config (s3:// URI or path)")
    parser.add_argument("--job", required=True, help="the job as JSON (training.data.TrainingJob)")
    parser.add_argument("--result", required=True, help="where rank 0 writes the final metrics as JSON")
    a = parser.parse_args(argv)
    logs.setup()
    cfg = config_from_yaml(store.read_bytes(a.config).decode())
    job = TrainingJob.from_json(store.read_bytes(a.job).decode())
    node = Rendezvous.from_env(os.environ)
    num_nodes = trainee(cfg, job.stage).tcfg.num_nodes
    if node.num_nodes != num_nodes:
        raise TrainingError(
            f"{job.stage}: the TrainJob runs {node.num_nodes} node(s) (PET_NNODES) but num_nodes is {num_nodes} "
            "in the config; every rank must train at the world size it was configured for"
        )
    print(
        f"node {node.node_rank} of {node.num_nodes}: rank 0 at {node.master_addr}:{node.master_port}",
        flush=True,
    )
    if node.node_rank == 0:  # before any writer of this attempt: what failed or killed writers left
        work = work_prefix(job.out_uri)
        removed, aborted = store.clean_unpublished(work)
        print(f"{work}: removed {removed} unpublished version(s), aborted {aborted} upload(s)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        return run_node(cfg, job, a.result, Path(tmp), node)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except TrainingError as e:  # a one-line refusal, no traceback: the pod's log shows it as it is
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
