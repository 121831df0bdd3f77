"""A trainer checkpoint's save: every rank uploads its share of the node's files, so the save takes the
node's streams to the store, not one process's.

The store is the real S3 server on loopback behind a proxy that passes 1 MB/s per connection (a stand-in
for the network: one TCP stream to an object store carries ~100-230 MB/s however wide the node's link). A
process keeps s3.STREAMS transfers in flight; two ranks keep twice as many. The same bytes (two ranks'
DCP-shaped files, 80 MiB) are saved once by rank 0 alone (a one-process job writing both ranks' files) and
once by two gloo processes (tests/save_ranks.py), each timed from the moment all ranks are ready."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from services import TcpProxy, free_port

from dynamicrubric import store
from dynamicrubric.training.checkpoints import fetch_checkpoint, writer_share

WORKER = Path(__file__).with_name("save_ranks.py")
SHARD_MIB = 20  # per shard file; 8 parts of 5 MiB per rank: one wave of s3.STREAMS transfers
RATE = 1.0e6  # bytes a second per connection: a wave takes ~5 s, long beside the save's own work


@pytest.mark.slow  # two saves of 80 MiB through a slow uplink, by two short-lived processes
def test_two_ranks_save_a_checkpoint_in_at_most_0_6_of_rank_0_alone(tmp_path, s3_env, seaweed):
    proxy = TcpProxy(seaweed.port, request_rate=RATE)
    env = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent), env.get("PYTHONPATH", "")])
    port = free_port()
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    str(rank),
                    str(port),
                    str(tmp_path),
                    f"s3://{s3_env}",
                    str(SHARD_MIB),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for rank in range(2)
        ]
        lines = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-3000:]
            lines += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    finally:
        proxy.close()
    alone = next(line["alone_s"] for line in lines if "alone_s" in line)
    together = max(line["together_s"] for line in lines if "together_s" in line)  # the slowest rank's
    print(f"save of 80 MiB: rank 0 alone {alone:.2f} s, two ranks {together:.2f} s ({together / alone:.2f}x)")
    assert together <= 0.6 * alone, (alone, together)

    # Both saves are the same complete checkpoint, and a resume fetches every file of it intact.
    manifests = [
        store.read_manifest(f"s3://{s3_env}/{w}.work/checkpoint-00003") for w in ("alone", "together")
    ]
    assert sorted(manifests[0]["files"]) == sorted(manifests[1]["files"])
    assert (
        len(manifests[1]["files"]) == 9
    )  # 2 x (2 shards + rng state) + .metadata, trainer_state, resume info
    fetched = Path(fetch_checkpoint(f"s3://{s3_env}/together.work/checkpoint-00003", tmp_path / "resume"))
    for rel, entry in manifests[1]["files"].items():
        assert (fetched / rel).stat().st_size == entry["size"], rel
    assert not (tmp_path / "together" / "checkpoint-3").exists()  # the scratch copy is dropped once stored


def test_each_writer_gets_a_near_even_share_of_the_bytes_and_every_file_once(tmp_path):
    sizes = {"a": 90, "b": 50, "c": 40, "d": 10, "e": 10, "f": 0}
    files = {}
    for rel, size in sizes.items():
        (tmp_path / rel).write_bytes(b"x" * size)
        files[rel] = tmp_path / rel
    shares = [writer_share(files, 2, i) for i in range(2)]
    assert sorted(rel for share in shares for rel in share) == sorted(sizes)
    assert [sum(sizes[rel] for rel in share) for share in shares] == [100, 100]
    assert writer_share(files, 1, 0) == files
