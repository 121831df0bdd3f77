"""One of the two processes of a training job's checkpoint save, for tests/test_checkpoint_save.py. Each
writes its own files of a DCP-shaped trainer checkpoint (as each rank's FSDP2 save does) in the node's
shared scratch folder and runs the trainer's checkpoint callback (training/checkpoints.py) on them, timed
from the moment every rank is ready. First rank 0 saves the same bytes alone (both ranks' files, before
the process group exists: a one-process job); then both ranks save together in a gloo group. It prints
JSON lines: {"alone_s"} (rank 0), then {"rank", "together_s"}.

    python save_ranks.py RANK PORT SCRATCH WORK_PREFIX SHARD_MIB
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from dynamicrubric.store import s3
from dynamicrubric.training import cpu_waits
from dynamicrubric.training.checkpoints import checkpoint_callback

STEP = 3


def write_files(folder: Path, rank: int, shard_bytes: int) -> None:
    """Rank `rank`'s files of an FSDP2 trainer checkpoint: its model and optimizer shards, its RNG state;
    rank 0 also the DCP metadata and the trainer's state."""
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        (folder / part).mkdir(parents=True, exist_ok=True)
        (folder / part / f"__{rank}_0.distcp").write_bytes(os.urandom(shard_bytes))
    (folder / f"rng_state_{rank}.pth").write_bytes(os.urandom(1500))
    if rank == 0:
        (folder / "pytorch_model_fsdp_0" / ".metadata").write_bytes(os.urandom(4000))
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": STEP}))


def save(scratch: Path, work_uri: str, rank: int, ranks: list[int], shard_bytes: int) -> float:
    """This process writes the files of `ranks` and runs the callback; the save's seconds."""
    for r in ranks:
        write_files(scratch / f"checkpoint-{STEP}", r, shard_bytes)
    args = SimpleNamespace(output_dir=str(scratch), process_index=rank)
    state = SimpleNamespace(
        global_step=STEP, is_world_process_zero=rank == 0, is_local_process_zero=rank == 0
    )
    callback = checkpoint_callback(work_uri, {"model_ref": "test", "config_digest": "0"})
    cpu_waits.barrier()  # every rank ready: the save starts together
    started = time.perf_counter()
    callback.on_save(args, state, None)
    return time.perf_counter() - started


def main() -> None:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    scratch, work, shard_bytes = Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]) << 20
    # Parts of 5 MiB (S3's smallest) from 5 MiB on, so test-sized shards go up in concurrent parts.
    s3.MULTIPART_THRESHOLD = s3.PART_SIZE = 5 << 20
    s3.s3_client()  # made once per process, long before a training job's first save
    if rank == 0:  # no process group yet: one process saves both ranks' files
        alone = save(scratch / "alone", f"{work}/alone.work", 0, [0, 1], shard_bytes)
        print(json.dumps({"alone_s": alone}), flush=True)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=300)
    )
    cpu_waits.init(timedelta(seconds=300))
    together = save(scratch / "together", f"{work}/together.work", rank, [rank], shard_bytes)
    print(json.dumps({"rank": rank, "together_s": together}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
