"""What `accelerate launch -m dynamicrubric.training.process` runs in every training process."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from dynamicrubric import store
from dynamicrubric.training import fsdp_hook
from dynamicrubric.training.data import TrainingJob
from dynamicrubric.training.grpo import train
from dynamicrubric.training.launcher import error_uri


def main(argv: list[str] | None = None) -> int:
    """What `accelerate launch -m dynamicrubric.training.process` runs in every process."""
    from dynamicrubric.infra.config_loading import config_from_yaml

    parser = argparse.ArgumentParser(
        prog="python -m dynamicrubric.training.process", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", required=True, help="the run's YAML config (a path or s3:// URI)")
    parser.add_argument(
        "--job", required=True, help="the job as JSON (training.data.TrainingJob; path or URI)"
    )
    parser.add_argument(
        "--result", default=None, help="write the final metrics here as JSON (a path or s3:// URI)"
    )
    a = parser.parse_args(argv)
    fsdp_hook.apply_if_asked()  # a test's FSDP2 path (training/fsdp_hook.py; no effect otherwise)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Local files from the one-node launcher; URIs in the store on a TrainJob's nodes (training/trainjob.py)
    cfg = config_from_yaml(store.read_bytes(a.config).decode())
    try:
        final = train(cfg, TrainingJob.from_json(store.read_bytes(a.job).decode()))
    except Exception as e:
        if a.result:  # for the launcher, which reports it as its own error
            from dynamicrubric.engines import EngineError, ServedError
            from dynamicrubric.infra.artifact_kinds import ArtifactError
            from dynamicrubric.infra.config import ConfigError
            from dynamicrubric.infra.models import ModelError

            user = isinstance(
                e, ArtifactError | ConfigError | store.StoreError | EngineError | ModelError | ValueError
            )
            served = isinstance(e, ServedError)  # a model server's failure: said again as one, whole
            error = {"user": user, "served": served, "type": type(e).__name__, "message": str(e)}
            # The first rank's error is the cause: the others' come after it, from a peer that died
            # ("Connection closed by peer"), and must not replace it.
            if not store.exists(error_uri(a.result)):
                store.write_bytes(error_uri(a.result), json.dumps(error).encode())
        raise
    from accelerate import PartialState

    state = PartialState()
    if a.result and state.is_main_process:
        store.write_bytes(a.result, json.dumps(final).encode())
    # Every rank is past its last collective (_grpo ends on a barrier); a rank that exits with the
    # process group still alive can abort in gloo's threads ("terminate called without an active
    # exception", exit code -6) and fail a finished task.
    state.destroy_process_group()
    return 0


if __name__ == "__main__":
    from dynamicrubric.infra.stopping import Stopped, raise_on_stop_signals

    raise_on_stop_signals()  # a stopped launch unwinds (its temp folders go) and prints no traceback
    try:
        code = main()
    except Stopped as e:
        sys.exit(e.exit_code)
    # Everything this process wrote is closed. Its interpreter's teardown (a full garbage collection over
    # torch, transformers and TRL, then triton's bindings printing leak warnings) would take seconds
    # more of every training task for nothing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
