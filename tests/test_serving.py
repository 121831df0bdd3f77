"""The training task's reward servers: how its GPUs are split, and the servers' life cycle.

The life-cycle tests start a stand-in for `vllm serve` (named as one: a few lines of http.server that
take vLLM's flags and answer /health), since vLLM cannot be imported in this venv; the real server is
started the same way by tests_vllm/test_served_rewards.py (`make test-vllm`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dynamicrubric.infra.config import ConfigError
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.infra.serving import ServerError, VLLMServer, free_port, reward_gpu_split, reward_servers

STAND_IN = """
import argparse, http.server, os, sys, time
args, _ = argparse.ArgumentParser().parse_known_args()
p = argparse.ArgumentParser(); p.add_argument("--port", type=int); p.add_argument("--model")
a, _ = p.parse_known_args()
print("stand-in serving", a.model, "CUDA_VISIBLE_DEVICES=" + os.environ.get("CUDA_VISIBLE_DEVICES", "-"), flush=True)
if os.environ.get("STAND_IN_MODE") == "crash":
    sys.exit("stand-in: cannot load the model")
if os.environ.get("STAND_IN_MODE") == "hang":
    time.sleep(3600)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", a.port), Health).serve_forever()
"""


def _cfg(tmp_path: Path, **serving):
    script = tmp_path / "stand_in_vllm.py"
    script.write_text(STAND_IN)
    return load_config(
        preset="tiny", overrides={"serving": {"command": [sys.executable, str(script)], **serving}}
    )


def test_the_paper_preset_splits_its_gpus_between_trainer_and_servers() -> None:
    cfg = load_config(preset="paper")
    gpus = [str(i) for i in range(8)]
    train, served = reward_gpu_split("train_policy", cfg, gpus)
    assert train == gpus[:6] and served == {"generator": ["6"], "verifier": ["7"]}
    train, served = reward_gpu_split("train_evaluator", cfg, gpus)
    assert train == gpus[:6] and served == {"verifier": ["6", "7"]}  # two data-parallel replicas of V
    with_url = load_config(preset="paper", overrides={"models": {"verifier_url": "http://judge:8000/v1"}})
    assert reward_gpu_split("train_policy", with_url, gpus)[1] == {"generator": ["6", "7"]}
    with pytest.raises(ConfigError, match="6 \\+ reward_gpus 2\\) = 8 GPUs, but this task sees 4"):
        reward_gpu_split("train_policy", cfg, gpus[:4])


def test_each_node_of_a_two_node_stage_serves_its_own_reward_models() -> None:
    """On 2 nodes (world_size 14, reward_gpus 2 in all) a node trains on 7 GPUs and serves its own copy of
    V on the 8th, which its processes call on localhost: no reward traffic between nodes."""
    two = {"world_size": 14, "reward_gpus": 2, "num_nodes": 2, "prompts_per_step": 35}
    cfg = load_config(preset="paper", overrides={"train_evaluator": two})
    gpus = [str(i) for i in range(8)]
    assert reward_gpu_split("train_evaluator", cfg, gpus) == (gpus[:7], {"verifier": ["7"]})
    with pytest.raises(ConfigError, match=r"reward_gpus 2\) / num_nodes 2 = 8 GPUs, but this task sees 7"):
        reward_gpu_split("train_evaluator", cfg, gpus[:7])


def test_servers_start_healthy_get_their_gpus_and_stop(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    models = {"generator": "/models/g", "verifier": "/models/v"}
    with reward_servers(
        cfg, "train_policy", models, {"generator": ["6"], "verifier": ["7"]}, tmp_path
    ) as urls:
        assert sorted(urls) == ["generator", "verifier"] and urls["generator"] != urls["verifier"]
    for role, gpu in (("generator", "6"), ("verifier", "7")):
        log = (tmp_path / f"{role}.log").read_text()
        assert f"/models/{role[0]} CUDA_VISIBLE_DEVICES={gpu}" in log
    import httpx

    with pytest.raises(httpx.TransportError):  # stopped on the way out
        httpx.get(f"{urls['generator']}/health", timeout=2)


def test_the_servers_stop_when_training_fails(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    url = None
    with (
        pytest.raises(RuntimeError, match="training failed"),
        reward_servers(cfg, "train_evaluator", {"verifier": "/m"}, {}, tmp_path) as urls,
    ):
        url = urls["verifier"]
        raise RuntimeError("training failed")
    import httpx

    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


def test_a_server_that_exits_or_never_gets_healthy_fails_with_its_log(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("STAND_IN_MODE", "crash")
    with (
        pytest.raises(
            ServerError, match="exited with code 1 before it was healthy(.|\n)*cannot load the model"
        ),
        reward_servers(_cfg(tmp_path), "train_evaluator", {"verifier": "/m"}, {}, tmp_path),
    ):
        pass
    monkeypatch.setenv("STAND_IN_MODE", "hang")
    server = VLLMServer(_cfg(tmp_path), "verifier", "/m", gpus=[], log_dir=tmp_path / "hang")
    try:
        with pytest.raises(ServerError, match="not healthy after 2 s"):
            server.wait_healthy(2)
    finally:
        server.stop(grace_s=5)
    assert server.process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(server.process.pid, 0)  # the whole process group is gone


def test_a_server_whose_port_another_process_takes_first_starts_again_on_another(
    tmp_path: Path, monkeypatch
) -> None:
    """free_port() lets its port go before the server binds it: here a real process takes that port in
    between, the first start fails with EADDRINUSE, and the server starts again on a new port. A port
    the caller chose is not changed behind its back."""
    import httpx

    taken = free_port()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_PORT, str(taken)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "bound"
        ports = iter([taken])  # the race, made certain: the first port chosen is the one just taken
        monkeypatch.setattr("dynamicrubric.infra.serving.free_port", lambda: next(ports, None) or free_port())
        with reward_servers(_cfg(tmp_path), "train_evaluator", {"verifier": "/m"}, {}, tmp_path) as urls:
            assert urls["verifier"] != f"http://127.0.0.1:{taken}"
            assert httpx.get(f"{urls['verifier']}/health", timeout=5).status_code == 200
        assert (tmp_path / "verifier.log").read_text().count("stand-in serving") == 2  # two starts
        server = VLLMServer(_cfg(tmp_path), "verifier", "/m", gpus=[], log_dir=tmp_path / "fixed", port=taken)
        try:
            with pytest.raises(ServerError, match="exited with code 1 before it was healthy"):
                server.wait_healthy(60)
        finally:
            server.stop(grace_s=5)
    finally:
        holder.kill()
        holder.wait()


HOLD_PORT = """
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
print("bound", flush=True); time.sleep(600)
"""


def test_fsdp_trainer_checkpoints_are_sharded() -> None:
    """Read from the accelerate config the GPU launch uses: resumable checkpoints as DCP shards (a full
    state dict would gather every rank's weights and optimizer states on rank 0 at each save)."""
    from importlib import resources

    import yaml

    text = resources.files("dynamicrubric").joinpath("accelerate", "fsdp.yaml").read_text()
    fsdp = yaml.safe_load(text)["fsdp_config"]
    assert (fsdp["fsdp_version"], fsdp["fsdp_state_dict_type"]) == (2, "SHARDED_STATE_DICT")


SCORE_BY_GROUPS = """
import json, sys
from datetime import timedelta
from accelerate import PartialState
from dynamicrubric.training import cpu_waits
from dynamicrubric.training.reward_parts import Scored, score_by_groups as _score_by_groups
state = PartialState(cpu=True)
cpu_waits.init(timedelta(minutes=5))  # as the trainer does once the process group exists
rank = state.process_index
local = [{"prompt_id": f"p{2 * rank + g}", "row": 4 * rank + 2 * g + i} for g in range(2) for i in range(2)]  # 2 groups of 2
calls = []
def score(rows, share):
    calls.append(len(rows))
    return Scored([10 * row["row"] for row in rows], {"rank_scored": float(len(rows))})
values, metrics = _score_by_groups(local, 2, score, served=True)
# a file per rank: two processes printing to one pipe can interleave their lines
with open(f"{sys.argv[1]}/rank-{rank}.json", "w") as f:
    json.dump({"rank": rank, "values": values, "calls": calls}, f)
# both ranks leave the group together: a rank that exits while gloo's threads still run aborts
# ("terminate called without an active exception", exit code -6)
state.wait_for_everyone()
state.destroy_process_group()
"""


def test_with_served_models_the_main_process_scores_the_whole_step(tmp_path: Path) -> None:
    """Two gloo processes: the main one sends the whole batch (all 4 groups) to the servers at once,
    the other scores nothing, and each gets back the scores of its own slice."""
    import json
    import subprocess

    script = tmp_path / "score.py"
    script.write_text(SCORE_BY_GROUPS)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--multi_gpu"]
    cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    # A port of its own: accelerate's default 29500 is shared with every other gloo run of the suite.
    cmd += ["--main_process_port", str(free_port()), str(script), str(tmp_path)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["calls"] for r in out] == [[8], []]  # rank 0 scored all 8 rows (4 groups), rank 1 was not asked
    assert out[0]["values"] == [0, 10, 20, 30] and out[1]["values"] == [40, 50, 60, 70]


def test_with_served_models_each_node_s_first_process_scores_its_node_s_share() -> None:
    """Who scores which groups (each rank's torchrun GROUP_RANK in): on two nodes of two processes each,
    group g is node g % 2's, sent by the node's first process (ranks 0 and 2); on one node rank 0 sends
    all; in-process models: every process its world-th groups, each in its rank-R folder."""
    from dynamicrubric.training.reward_parts import _split

    assert _split(True, [0, 0, 1, 1], 5) == ([0, 1, 0, 1, 0], {0: 0, 1: 2}, "node")
    assert _split(True, [0, 0], 3) == ([0, 0, 0], {0: 0}, "rank")
    assert _split(False, [0, 0, 1, 1], 5) == ([0, 1, 2, 3, 0], {0: 0, 1: 1, 2: 2, 3: 3}, "rank")


def test_a_step_scored_in_parts_logs_the_step_s_counts_not_their_mean() -> None:
    """TRL averages what each process logs; a step in parts is logged once, its parts combined: request
    and group counts add up, a time is the slowest part's, a rate is weighted by the parts' groups."""
    from dynamicrubric.training.reward_parts import combined_metrics

    names = ("judge/calls_ok", "rewards/failed_groups", "time/judge_s", "judge/yes_rate")
    parts = [
        (2, dict(zip(names, (8.0, 1.0, 3.0, 0.5), strict=True))),
        (1, dict(zip(names, (4.0, 0.0, 5.0, 0.2), strict=True))),
        (0, {}),  # a process that scored nothing
    ]
    assert combined_metrics(parts) == pytest.approx(dict(zip(names, (12.0, 1.0, 5.0, 0.4), strict=True)))
