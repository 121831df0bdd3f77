"""The online trainers (TRL GRPOTrainer + DynamicRubric rewards) on the tiny-random model.

Direction of the update, determinism of per-step artifacts and weights, resume after SIGKILL, and
the checks that stop a misconfigured run before it starts. Every run goes through `launcher.launch`,
the same `accelerate launch` path the pipeline's training components use.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import psutil
import pytest
import torch
from safetensors.torch import load_file

from dynamicrubric import store, tasks
from dynamicrubric.engines import load_engine
from dynamicrubric.infra.artifact_kinds import empty_table
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.config_loading import load_config
from dynamicrubric.infra.models import resolve_model
from dynamicrubric.scoring.rollout import policy_prompt
from dynamicrubric.training import checkpoints, data, grpo, launcher
from dynamicrubric.training.data import TrainingJob

FAST = {
    "max_steps": 1,
    "prompts_per_step": 2,
    "per_device_train_batch_size": 4,
    "learning_rate": 5e-3,
    "torch_threads": 1,
}


def _cfg(**overrides):
    base = {"train_policy": FAST, "train_evaluator": FAST, "rubrics": {"constrained": True}}
    for key, value in overrides.items():
        base[key] = {**base.get(key, {}), **value}
    return load_config(preset="tiny", overrides=base)


def _prompts(folder: Path, cfg) -> str:
    uri = str(folder / "prompts.parquet")
    write_artifact(uri, "prompts", tasks.configured_prompts(cfg.data, "train"))
    return uri


def _train_policy(cfg, folder: Path, **kwargs) -> dict:
    return launcher.launch(
        cfg,
        TrainingJob(
            "train-policy",
            prompts_uri=_prompts(folder, cfg),
            policy="tiny-random",
            generator="tiny-random",
            out_uri=str(folder / "policy"),
            steps_uri=str(folder / "steps"),
            metrics_uri=str(folder / "metrics.parquet"),
            round_idx=1,
            **kwargs,
        ),
    )


def kill_after_checkpoint(
    cfg, job: TrainingJob, step: int, env: dict[str, str] | None = None, world_size: int = 1
) -> str:
    """A training launch SIGKILLed (with its whole process group) once the trainer checkpoint of `step`
    is stored: the trainer stalls there (checkpoints.STALL_ENV) until the kill. Returns what it printed."""
    files = Path(job.steps_uri).parent
    (files / "config.yaml").write_text(cfg.to_yaml())
    (files / "job.json").write_text(job.to_json())
    args = ["--config", str(files / "config.yaml"), "--job", str(files / "job.json")]
    env = {**os.environ, **(env or {}), checkpoints.STALL_ENV: str(step)}
    proc = subprocess.Popen(
        launcher.launch_command(world_size, args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 600
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if f"stalled after step {step}" in line or time.monotonic() > deadline:
            break
    # torchrun (several processes) starts each worker in a session of its own: kill them by pid too
    workers = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for worker in workers:
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.kill()
    proc.wait()
    psutil.wait_procs(workers, timeout=30)
    return "".join(lines)


def _sequence_logprobs(model: str, prompts: list[str], responses: list[str]) -> np.ndarray:
    engine = load_engine(str(resolve_model(model)), load_config(preset="tiny").engine)
    texts = [policy_prompt(engine, p) for p in prompts]
    return np.array([sum(lp) for lp in engine.logprobs(texts, responses)])


def _group_advantages(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    adv = np.zeros_like(values)
    for g in np.unique(groups):
        idx = groups == g
        adv[idx] = (values[idx] - values[idx].mean()) / (values[idx].std(ddof=1) + 1e-4)
    return adv


def test_policy_step_moves_probability_towards_higher_scores(tmp_path):
    """One on-policy step with the pointwise judge (soft scores, so groups are not tied): the change in
    each completion's log-probability correlates with its group-normalised score."""
    cfg = _cfg(judge={"variant": "pointwise"}, aggregate={"soft": True})
    final = _train_policy(cfg, tmp_path)
    assert final["reward_std"] > 0
    step = tmp_path / "steps" / "step-00001"
    rollouts = read_frame(str(step / "rollouts.parquet"), "rollouts")
    scores = read_frame(str(step / "scores.parquet"), "scores")
    df = rollouts.merge(scores, on=["prompt_id", "sample_idx"])
    assert len(df) == cfg.train_policy.prompts_per_step * cfg.rollout.k
    adv = _group_advantages(df["score"].to_numpy(), df["prompt_id"].to_numpy())
    before = _sequence_logprobs("tiny-random", df["prompt"].tolist(), df["response"].tolist())
    after = _sequence_logprobs(str(tmp_path / "policy"), df["prompt"].tolist(), df["response"].tolist())
    assert float(np.dot(adv, after - before)) > 0


def test_per_step_artifacts_validate_and_metrics_are_recorded(tmp_path):
    # With item dropout: the step's rubrics carry judged_items, which the contract checks
    cfg = _cfg(train_policy={"max_steps": 2}, judge={"item_dropout": 0.5})
    final = _train_policy(cfg, tmp_path)
    for step in (1, 2):
        folder = tmp_path / "steps" / f"step-{step:05d}"
        for kind in ("rollouts", "rubrics", "judgments", "scores", "rewards", "diagnostics", "metrics"):
            frame = read_frame(str(folder / f"{kind}.parquet"), kind)  # validates against the contract
            assert set(frame["step"]) == {step}, kind  # each row says which step wrote it
    metrics = read_frame(str(tmp_path / "metrics.parquet"), "metrics")
    names = set(metrics["name"])
    for name in ("reward_mean", "reward_std", "kl", "entropy", "signal/tie_rate", "signal/uniformity_rate",
                 "judge/yes_rate", "rubrics/parse_rate", "rewards/length_corr_groups", "judge/items_kept",
                 "judge/items_dropped"):  # fmt: skip
        assert name in names, name
    rubrics = read_frame(str(tmp_path / "steps" / "step-00001" / "rubrics.parquet"), "rubrics")
    judgments = read_frame(str(tmp_path / "steps" / "step-00001" / "judgments.parquet"), "judgments")
    assert len(judgments) == cfg.rollout.k * rubrics["judged_items"].map(len).sum()
    assert sorted(set(metrics["step"])) == [1, 2]
    # The time measurements come back apart (for MLflow): a rerun could not write the same artifact
    assert not any(name.startswith("time/") for name in names)
    timings = pd.DataFrame(final["timings"])
    for name in ("time/step_s", "time/generation_s", "time/reward_s", "time/update_s"):
        assert sorted(timings[timings["name"] == name]["step"]) == [1, 2], name
    summary = json.loads((tmp_path / "policy" / checkpoints.SUMMARY_FILE).read_text())
    assert final["train_wall_s"] > 0 and "train_wall_s" not in summary["final"]
    assert not any(row["name"].startswith("time/") for row in summary["metrics_rows"])
    assert store.is_complete(str(tmp_path / "policy"))
    assert not Path(f"{tmp_path / 'policy'}.work").exists()  # trainer checkpoints cleaned up


def test_prompts_with_and_without_reference_and_meta_train(tmp_path):
    """A user's pool where only some rows carry a reference or meta: the missing ones reach the trainer
    as None (pandas 3 reads them as NaN, which `Dataset.from_dict` refused after the models loaded)."""
    cfg = _cfg(data={"num_prompts": 4})
    rows = tasks.configured_prompts(cfg.data, "train").to_dict("records")
    rows[1]["reference"] = rows[2]["meta"] = rows[3]["reference"] = rows[3]["meta"] = None
    uri = str(tmp_path / "mixed.parquet")
    write_artifact(uri, "prompts", rows)
    launcher.launch(cfg, TrainingJob("train-policy", prompts_uri=uri, policy="tiny-random", generator="tiny-random",
        out_uri=str(tmp_path / "policy"), steps_uri=str(tmp_path / "steps"), round_idx=1,
    ))  # fmt: skip
    assert store.is_complete(str(tmp_path / "policy"))
    assert read_frame(uri, "prompts")["reference"].isna().sum() == 2  # the file really mixes them


def test_aggregate_stage_reruns_on_a_step_artifacts(tmp_path):
    from dynamicrubric.cli import main

    cfg = _cfg()
    _train_policy(cfg, tmp_path)
    step = tmp_path / "steps" / "step-00001"
    out = tmp_path / "rerun"
    code = main(
        ["stage", "aggregate", "--preset", "tiny", "--judgments", str(step / "judgments.parquet"),
         "--candidate-sets", str(step / "rollouts.parquet"), "--rubrics", str(step / "rubrics.parquet"),
         "--out-scores", str(out / "scores.parquet"), "--out-rewards", str(out / "rewards.parquet"),
         "--out-diagnostics", str(out / "diagnostics.parquet"), "--out-metrics", str(out / "metrics.parquet")]
    )  # fmt: skip
    assert code == 0
    # the same scores; the trainer's copy also carries the step that wrote it
    trained = read_frame(str(step / "scores.parquet"), "scores")
    assert set(trained.pop("step")) == {1}
    pd.testing.assert_frame_equal(read_frame(str(out / "scores.parquet"), "scores"), trained)


def _candidate_sets(folder: Path, cfg) -> tuple[str, str]:
    """Candidate sets from one tiny rollout, with one user-ranked anchor list among them."""
    from dynamicrubric.stages.runner import run_stage

    y = cfg.to_yaml()
    prompts = _prompts(folder, cfg)
    lists = str(folder / "lists.parquet")
    anchors = empty_table("anchors").to_pylist() + [
        {"list_id": "nectar/0", "sample_idx": i, "rank": i + 1, "prompt": "What is 2 + 3?",
         "response": r, "source": "test"}
        for i, r in enumerate(["5", "It is 5.", "6", "I do not know"])
    ]  # fmt: skip
    write_artifact(lists, "anchors", anchors)
    rollouts = str(folder / "rollouts.parquet")
    run_stage("rollout", y, "", 1, label="generator", prompts=prompts, out_rollouts=rollouts, policy="tiny-random",
              shard=0, num_shards=1, seed=0)  # fmt: skip
    cand, ranked = str(folder / "candidates.parquet"), str(folder / "anchors.parquet")
    run_stage("candidates", y, "", 1, rollouts=rollouts, prompts=prompts, anchor_lists=lists, shard=0, num_shards=1,
              out_candidate_sets=cand, out_anchors=ranked)  # fmt: skip
    return cand, ranked


def test_evaluator_step_follows_the_mixed_advantage(tmp_path):
    """One generator step: rubric samples with a higher A = norm(R_disc) + λ·norm(R_anchor) gain
    log-probability; constrained decoding makes every rubric not cut by the token limit parse."""
    cfg = _cfg(
        aggregate={"soft": True}, train_evaluator={"prompts_per_step": 4, "per_device_train_batch_size": 4}
    )
    cand, ranked = _candidate_sets(tmp_path, cfg)
    final = launcher.launch(
        cfg,
        TrainingJob(
            "train-evaluator",
            candidates=[cand],
            anchors=[ranked],
            generator="tiny-random",
            out_uri=str(tmp_path / "generator"),
            steps_uri=str(tmp_path / "steps"),
            metrics_uri=str(tmp_path / "metrics.parquet"),
            round_idx=1,
        ),
    )
    step = tmp_path / "steps" / "step-00001"
    rubrics = read_frame(str(step / "rubrics.parquet"), "rubrics")
    finished = rubrics[rubrics["finish_reason"] == "stop"]
    assert len(finished) and (finished["parse_status"] == "json").all()
    assert final["rubrics/parse_rate"] >= len(finished) / len(rubrics)
    rewards = read_frame(str(step / "rewards.parquet"), "rewards")
    df = rubrics.merge(rewards, on=["prompt_id", "rubric_idx"])
    groups = df["prompt_id"].to_numpy()
    adv = _group_advantages(df["r_disc"].to_numpy(), groups)
    if df["r_anchor"].notna().any():
        has = df["r_anchor"].notna().to_numpy()
        adv[has] += cfg.train_evaluator.anchor_weight * _group_advantages(
            df.loc[has, "r_anchor"].to_numpy(float), groups[has]
        )
    assert np.abs(adv).sum() > 0, "no signal: every rubric sample of every set scored the same"
    before = _sequence_logprobs("tiny-random", df["generator_prompt"].tolist(), df["completion"].tolist())
    after = _sequence_logprobs(
        str(tmp_path / "generator"), df["generator_prompt"].tolist(), df["completion"].tolist()
    )
    assert float(np.dot(adv, after - before)) > 0


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def test_same_seed_twice_in_one_process_gives_identical_step_artifacts_and_weights(tmp_path):
    """`grpo.train` called twice in this process (as a notebook or a sweep would): the second call
    works (process-wide hooks are registered once) and, with the same seed, writes the same bytes."""
    cfg = _cfg(train_policy={"max_steps": 2})
    threads = torch.get_num_threads()
    try:
        for run in ("a", "b"):
            (tmp_path / run).mkdir()
            folder = tmp_path / run
            grpo.train(cfg, TrainingJob("train-policy", str(folder / "policy"), str(folder / "steps"),
                                        round_idx=1, policy="tiny-random", generator="tiny-random",
                                        prompts_uri=_prompts(folder, cfg)))  # fmt: skip
    finally:
        torch.set_num_threads(threads)  # the trainer sets the config's torch_threads for its process
    for kind in ("rollouts", "rubrics", "judgments", "scores"):
        for step in (1, 2):
            rel = Path("steps") / f"step-{step:05d}" / f"{kind}.parquet"
            assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    a, b = _weights(tmp_path / "a" / "policy"), _weights(tmp_path / "b" / "policy")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], _weights(resolve_model("tiny-random"))[k]) for k in a)


def test_sigkill_mid_run_then_rerun_equals_uninterrupted(tmp_path):
    """A training process killed after its step-2 checkpoint reached the store, then started again,
    resumes from that checkpoint and ends with the weights of an uninterrupted run."""
    # 8 prompts, 2 a step: the 4 steps stay inside one pass over the pool. TRL's sampler reshuffles each
    # pass from its seed alone, so a resume after a whole pass would draw another order (docs/training.md).
    # With item dropout, whose seeded subsets must not depend on what the process scored before.
    cfg = _cfg(
        train_policy={"max_steps": 4, "save_steps": 2}, data={"num_prompts": 8}, judge={"item_dropout": 0.5}
    )
    (tmp_path / "whole").mkdir()
    _train_policy(cfg, tmp_path / "whole")

    folder = tmp_path / "killed"
    folder.mkdir()
    job = TrainingJob("train-policy", str(folder / "policy"), str(folder / "steps"), round_idx=1,
                      policy="tiny-random", generator="tiny-random", prompts_uri=_prompts(folder, cfg))  # fmt: skip
    kill_after_checkpoint(cfg, job, step=2)
    assert store.is_complete(str(folder / "policy.work" / "checkpoint-00002"))
    assert not store.is_complete(str(folder / "policy"))

    launcher.launch(cfg, job)
    for step in (3, 4):  # the resumed steps sampled and scored exactly what the uninterrupted run did
        for kind in ("rollouts", "rubrics", "judgments"):
            rel = Path("steps") / f"step-{step:05d}" / f"{kind}.parquet"
            assert (tmp_path / "whole" / rel).read_bytes() == (folder / rel).read_bytes(), rel
    a, b = _weights(tmp_path / "whole" / "policy"), _weights(folder / "policy")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_checkpoint_is_merged_and_loads_plainly(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = _cfg(train_policy={"lora_rank": 4, "lora_alpha": 8})
    _train_policy(cfg, tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert not any("lora" in name for name, _ in model.named_parameters())


def test_a_misconfigured_run_fails_before_training(tmp_path):
    cfg = _cfg(train_policy={"prompts_per_step": 3, "per_device_train_batch_size": 8})
    with pytest.raises(ValueError, match="must split evenly"):
        data.check_batch("train-policy", cfg.train_policy, cfg.rollout.k, pool=3)
    with pytest.raises(ValueError, match="the pool holds only 1 prompt"):
        data.check_batch("train-policy", _cfg().train_policy, cfg.rollout.k, pool=1)
    # one process started for a config that asks for two: refused before any model is loaded
    cfg = _cfg(train_policy={"world_size": 2})
    with pytest.raises(ValueError, match="world_size is 2 in the config but 1 process"):
        grpo.train(cfg, TrainingJob("train-policy", str(tmp_path / "p"), str(tmp_path / "s"),
                                    policy="tiny-random", prompts_uri=_prompts(tmp_path, cfg)))  # fmt: skip
    assert not (tmp_path / "p").exists()


def test_paper_preset_launches_one_process_per_gpu():
    """One process per training GPU: the task's other reward_gpus serve the reward's models."""
    cfg = load_config(preset="paper")
    tcfg = cfg.train_policy
    cmd = launcher.launch_command(tcfg.world_size, ["train-policy"])
    assert cmd[cmd.index("--num_processes") + 1] == "6"
    assert cfg.pipeline.resources["train_policy"].gpus == tcfg.world_size + tcfg.reward_gpus == 6 + 2
    from dynamicrubric.infra.config import ConfigError
    from dynamicrubric.pipelines.co_evolution import build_pipeline

    # refused when the config loads (vLLM's GPU memory plan) ...
    with pytest.raises(
        ConfigError, match=r"gpus is 8 but \(train_policy.world_size 4 \+ reward_gpus 2\) = 6"
    ):
        load_config(preset="paper", overrides={"train_policy": {"world_size": 4}})
    # ... and, for any engine, when the pipeline compiles
    hf = load_config(
        preset="paper", overrides={"engine": {"engine": "hf"}, "train_policy": {"world_size": 4}}
    )
    with pytest.raises(ConfigError, match="one process per training GPU"):
        build_pipeline(hf)


def test_two_cpu_processes_score_whole_groups(tmp_path):
    """accelerate's multi-CPU launch (gloo) through the same launcher: each process scores whole groups
    of K (its own step folder), and the run ends with one complete checkpoint."""
    cfg = _cfg(train_policy={"max_steps": 1, "per_device_train_batch_size": 2, "world_size": 2})
    _train_policy(cfg, tmp_path)
    step = tmp_path / "steps" / "step-00001"
    for rank in (0, 1):
        rollouts = read_frame(str(step / f"rank-{rank}" / "rollouts.parquet"), "rollouts")
        assert rollouts.groupby("prompt_id").size().eq(cfg.rollout.k).all()
    assert store.is_complete(str(tmp_path / "policy"))


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 3,
    reason="needs 3 CUDA GPUs (vLLM): one to train on, one each for the G and V servers",
)
def test_online_trainers_on_vllm(tmp_path):
    """The GPU path: the trained model generates through TRL's colocated vLLM (sleep mode on), the
    generator's rubric samples are constrained by vLLM structured outputs, and the reward reaches G and V
    through the `vllm serve` processes the task starts on its reward GPUs. No GPU on the dev machines."""
    plan = {"world_size": 1, "reward_gpus": 2, "vllm_gpu_memory_utilization": 0.2}
    cfg = _cfg(
        engine={"engine": "vllm", "device": "cuda"},
        train_policy=plan,
        train_evaluator=plan,
        serving={"gpu_memory_utilization": 0.2, "start_timeout_s": 900},
    )
    final = _train_policy(cfg, tmp_path / "policy-run")
    assert store.is_complete(str(tmp_path / "policy-run" / "policy")) and "reward_mean" in final
    assert final["judge/calls_ok"] > 0 and final["rewards/failed_groups"] == 0
    cand, ranked = _candidate_sets(tmp_path, cfg)
    final = launcher.launch(cfg, TrainingJob("train-evaluator", candidates=[cand], anchors=[ranked], generator="tiny-random",
        out_uri=str(tmp_path / "generator"), steps_uri=str(tmp_path / "steps"), round_idx=1,
    ))  # fmt: skip
    assert final["rubrics/parse_rate"] == 1.0


def test_smaller_lm_head_tiles_change_no_number(monkeypatch):
    """bound_lm_head_tiles cuts the CPU memory of TRL's fused LM head; log-probs, entropies and their
    gradients must come out bit for bit the same as with TRL's own tiles."""
    from trl.kernels import ChunkedLogProbFunction, chunked_logprob

    monkeypatch.setattr(chunked_logprob, "TOKEN_CHUNK_SIZE", chunked_logprob.TOKEN_CHUNK_SIZE)
    gen = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = 1100, 64, 40_000  # several 256-token tiles, two vocabulary chunks
    weight = torch.randn(vocab, hidden_size, generator=gen) * 0.1
    hidden = torch.randn(tokens, hidden_size, generator=gen)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    upstream = torch.randn(2, tokens, generator=gen)

    def run() -> tuple[torch.Tensor, ...]:
        h = hidden.clone().requires_grad_(True)
        logps, entropy, *_ = ChunkedLogProbFunction.apply(
            h, weight, None, targets, 0.7, 32768, None, 1.0, ("entropy",)
        )
        ((logps * upstream[0]).sum() + (entropy * upstream[1]).sum()).backward()
        return logps.detach(), entropy.detach(), h.grad

    before = run()
    launcher.bound_lm_head_tiles()
    assert chunked_logprob.TOKEN_CHUNK_SIZE == launcher.CPU_LM_HEAD_TILE_TOKENS < tokens
    after = run()
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow  # a 2-process run whose trainer checkpoint and export take about a minute to upload
def test_ranks_wait_out_a_slow_checkpoint_upload_beyond_the_collectives_timeout(
    tmp_path, s3_env, seaweed, monkeypatch
):
    """While rank 0 uploads a trainer checkpoint, the other ranks wait on a group of their own with
    `wait_timeout_s`, not in the next step's collective: an upload slower than the process group's
    timeout (as a ~92 GiB checkpoint is slower than NCCL's 10 minutes below ~165 MB/s) no longer ends the
    job. Here the uplink to a real S3 server passes 0.4 MB/s a connection, so the ~31 MB full-finetune
    checkpoint of tiny-random takes far longer than the 10 s process group timeout (gloo on CPU, NCCL's
    role on GPU); before the transfer group the other rank failed with "Timed out waiting 10000ms"."""
    from services import TcpProxy

    proxy = TcpProxy(seaweed.port, request_rate=0.4e6)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    store.reset_client()
    cfg = _cfg(
        train_policy={"max_steps": 2, "save_steps": 1, "per_device_train_batch_size": 2, "world_size": 2,
                      "process_group_timeout_s": 10, "torch_threads": 1},
    )  # fmt: skip
    out = f"s3://{s3_env}/policy"
    try:
        final = launcher.launch(
            cfg,
            TrainingJob("train-policy", prompts_uri=_prompts(tmp_path, cfg), policy="tiny-random",
                        generator="tiny-random", out_uri=out, steps_uri=str(tmp_path / "steps"), round_idx=1),
        )  # fmt: skip
    finally:
        proxy.close()
        store.reset_client()
    assert store.is_complete(out) and "reward_mean" in final


def test_the_step_split_counts_generation_on_the_vllm_path_too(monkeypatch):
    """TRL's colocated vLLM generates through `trainer.vllm_generation.generate`, never model.generate:
    grpo wraps it with the same timer, so time/generation_s is not 0 where generation dominates."""
    from types import SimpleNamespace

    from dynamicrubric.training import monitoring

    clock = iter([10.0, 13.5])  # the vLLM call's start and end, as perf_counter reads them
    monkeypatch.setattr(monitoring.time, "perf_counter", lambda: next(clock))
    timer = monitoring.TimedGenerate(lambda *a, **k: None, tokenizer=None, max_items=None, vocab_size=0)
    vllm_generation = SimpleNamespace(generate=lambda prompts: ["ids"] * len(prompts))
    vllm_generation.generate = timer.timed(vllm_generation.generate)
    assert vllm_generation.generate(["a", "b"]) == ["ids", "ids"]
    state = SimpleNamespace(log_history=[{"step_time": 5.0, "time/reward_s": 1.0}])
    monitoring.step_split_callback(timer).on_log(None, state, None)
    assert state.log_history[-1]["time/generation_s"] == 3.5
    assert state.log_history[-1]["time/update_s"] == 5.0 - 3.5 - 1.0
