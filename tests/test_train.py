"""Training stages on the tiny-random model: direction of the update, determinism, LoRA, resume after SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dynamicrubric import store
from dynamicrubric.artifacts import read_frame, write_artifact
from dynamicrubric.config import EvaluatorTrainConfig, TrainConfig, load_config
from dynamicrubric.models import resolve_model
from dynamicrubric.train import STALL_ENV, SUMMARY_FILE, resolve_model_ref, train_evaluator, train_policy

PROMPTS = {"p0": "What is 2 + 3?", "p1": "What is 4 + 4?", "p2": "Say yes or no."}
RESPONSES = ["The answer is 5.", "yes", "The quick brown fox.", "no no no"]
# mean over two rubric samples: sample 0 best, sample 3 worst in every group
SCORES = [(1.0, 1.0), (0.5, 1.0), (0.5, 0.0), (0.0, 0.0)]


def write_policy_data(folder: Path) -> tuple[str, str]:
    rollouts, scores = [], []
    for pid, prompt in PROMPTS.items():
        for k, response in enumerate(RESPONSES):
            rollouts.append(
                {"prompt_id": pid, "sample_idx": k, "prompt": prompt, "response": response, "num_tokens": 4,
                 "finish_reason": "stop" if k % 2 == 0 else "length", "policy": "tiny-random", "seed": 0}
            )  # fmt: skip
            for r, s in enumerate(SCORES[k]):
                scores.append(
                    {"prompt_id": pid, "rubric_idx": r, "sample_idx": k, "score": s, "num_items": 2}
                )
    write_artifact(str(folder / "rollouts.parquet"), "rollouts", rollouts)
    write_artifact(str(folder / "scores.parquet"), "scores", scores)
    return str(folder / "rollouts.parquet"), str(folder / "scores.parquet")


RUBRIC_TEXTS = [
    '[{"text": "states the final answer", "weight": 5}]',
    '[{"text": "is polite", "weight": 1}]',
    "- mentions the fox",
    "yes no yes",
]


def write_evaluator_data(folder: Path) -> tuple[str, str]:
    rubrics, rewards = [], []
    for c, pid in enumerate(["set0", "set1"]):
        for g, text in enumerate(RUBRIC_TEXTS):
            rubrics.append(
                {"prompt_id": pid, "rubric_idx": g, "variant": "dynamic", "generator": "tiny-random",
                 "generator_prompt": f"Task {c}: write a rubric that separates the responses.",
                 "completion": text, "parse_status": "lines", "finish_reason": "stop", "items": []}
            )  # fmt: skip
            # r_disc favours sample 0, r_anchor (only on set0) agrees: sample 0 best, sample 3 worst
            rewards.append({"prompt_id": pid, "rubric_idx": g, "r_disc": [0.25, 0.2, 0.1, 0.0][g],
                            "r_anchor": [-0.5, -1.0, -1.5, -3.0][g] if c == 0 else None, "num_items": 1})  # fmt: skip
    write_artifact(str(folder / "rubrics.parquet"), "rubrics", rubrics)
    write_artifact(str(folder / "rewards.parquet"), "rewards", rewards)
    return str(folder / "rubrics.parquet"), str(folder / "rewards.parquet")


def mean_logprob(model_dir: str | Path, pairs: list[tuple[str, str, bool]]) -> float:
    """Mean over pairs of the per-token log-prob of the completion, computed one unpadded sequence at a time."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for user, completion, eos in pairs:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
        )
        p = tok(prompt, add_special_tokens=False).input_ids
        c = tok(completion, add_special_tokens=False).input_ids + ([tok.eos_token_id] if eos else [])
        with torch.no_grad():
            logits = model(torch.tensor([p + c])).logits[0]
        logp = torch.log_softmax(logits[len(p) - 1 : -1], -1).gather(-1, torch.tensor(c)[:, None])
        out.append(logp.mean().item())
    return sum(out) / len(out)


def tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_same_tensors(a: str | Path, b: str | Path) -> None:
    ta, tb = tensors(a), tensors(b)
    assert ta and ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


FAST = {"learning_rate": 3e-4, "epochs": 2, "micro_batch_size": 4, "grad_accum": 1, "beta": 0.01, "seed": 0}


def test_train_policy_raises_best_and_lowers_worst(tmp_path):
    rollouts, scores = write_policy_data(tmp_path)
    out, metrics_uri = str(tmp_path / "policy-1"), str(tmp_path / "metrics.parquet")
    final = train_policy(
        rollouts, scores, "tiny-random", out, TrainConfig(**FAST), metrics_uri=metrics_uri, round_idx=2
    )

    assert store.is_complete(out)
    assert not Path(
        out + ".work", "state.pt"
    ).exists()  # resumable state is gone once the checkpoint is complete
    best = [(p, RESPONSES[0], True) for p in PROMPTS.values()]
    worst = [(p, RESPONSES[3], False) for p in PROMPTS.values()]
    base = resolve_model("tiny-random")
    assert mean_logprob(out, best) > mean_logprob(base, best) + 0.05
    assert mean_logprob(out, worst) < mean_logprob(base, worst) - 0.05

    m = read_frame(metrics_uri, "metrics")
    assert set(m["stage"]) == {"train_policy"} and set(m["round"]) == {2}
    assert set(m["name"]) == {
        "loss",
        "kl",
        "clip_frac",
        "advantage_mean",
        "reward_mean",
        "grad_norm",
        "tokens_per_s",
    }
    assert sorted(set(m["step"])) == [1, 2, 3, 4, 5, 6]  # 12 responses / 4 per step, 2 epochs
    kl = m[m["name"] == "kl"].sort_values("step")["value"].tolist()
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 0  # starts at the reference, then moves away
    assert (
        final["steps"] == 6 and final["loss"] == m[(m["name"] == "loss") & (m["step"] == 6)]["value"].item()
    )
    # reward mean over the whole epoch equals the mean score (1 + 0.75 + 0.25 + 0) / 4
    rewards = m[(m["name"] == "reward_mean") & m["step"].isin([1, 2, 3])]["value"].mean()
    assert rewards == pytest.approx(0.5)


def test_train_evaluator_raises_best_and_lowers_worst(tmp_path):
    rubrics, rewards = write_evaluator_data(tmp_path)
    out = str(tmp_path / "generator-1")
    cfg = EvaluatorTrainConfig(**FAST, anchor_weight=1.0)
    train_evaluator(rubrics, rewards, "tiny-random", out, cfg, metrics_uri=str(tmp_path / "m.parquet"))
    prompts = [f"Task {c}: write a rubric that separates the responses." for c in range(2)]
    best = [(p, RUBRIC_TEXTS[0], False) for p in prompts]
    worst = [(p, RUBRIC_TEXTS[3], False) for p in prompts]
    base = resolve_model("tiny-random")
    assert mean_logprob(out, best) > mean_logprob(base, best) + 0.05
    assert mean_logprob(out, worst) < mean_logprob(base, worst) - 0.05
    assert set(read_frame(str(tmp_path / "m.parquet"), "metrics")["stage"]) == {"train_evaluator"}


def test_same_seed_same_tensors_and_complete_checkpoint_is_skipped(tmp_path):
    rollouts, scores = write_policy_data(tmp_path)
    cfg = TrainConfig(**{**FAST, "epochs": 1, "loss_averaging": "sequence"})
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    final = train_policy(rollouts, scores, "tiny-random", a, cfg)
    train_policy(rollouts, scores, "tiny-random", b, cfg)
    assert_same_tensors(a, b)
    assert any(not torch.equal(t, tensors(resolve_model("tiny-random"))[k]) for k, t in tensors(a).items())

    # A complete checkpoint is left alone, and the call answers with the recorded final metrics.
    mtimes = {p: p.stat().st_mtime_ns for p in Path(a).iterdir()}
    assert (
        train_policy(rollouts, scores, "tiny-random", a, cfg, metrics_uri=str(tmp_path / "m.parquet"))
        == final
    )
    assert {p: p.stat().st_mtime_ns for p in Path(a).iterdir()} == mtimes
    assert len(read_frame(str(tmp_path / "m.parquet"), "metrics")) == 7 * 3

    # Gradient checkpointing trades compute for memory; the update is the same up to float rounding.
    d = str(tmp_path / "d")
    train_policy(rollouts, scores, "tiny-random", d, cfg.model_copy(update={"gradient_checkpointing": True}))
    for k, t in tensors(a).items():
        assert torch.allclose(t, tensors(d)[k], atol=1e-6), k

    # A different seed changes the data order and so the result.
    c = str(tmp_path / "c")
    train_policy(rollouts, scores, "tiny-random", c, TrainConfig(**{**FAST, "epochs": 1, "seed": 1}))
    assert any(not torch.equal(t, tensors(c)[k]) for k, t in tensors(a).items())


def test_lora_checkpoint_is_merged_and_loads_plainly(tmp_path):
    from transformers import AutoModelForCausalLM

    rollouts, scores = write_policy_data(tmp_path)
    out = str(tmp_path / "lora")
    train_policy(
        rollouts, scores, "tiny-random", out, TrainConfig(**{**FAST, "lora_rank": 4, "lora_alpha": 8})
    )
    base, trained = tensors(resolve_model("tiny-random")), tensors(out)
    assert trained.keys() == base.keys()  # no adapter keys: LoRA merged in
    changed = [k for k in base if not torch.equal(base[k], trained[k])]
    assert changed and all("proj" in k for k in changed)  # only the adapted linear layers moved
    assert not (Path(out) / "adapter_config.json").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    best = [(p, RESPONSES[0], True) for p in PROMPTS.values()]
    assert mean_logprob(out, best) > mean_logprob(resolve_model("tiny-random"), best)


def test_bad_inputs_are_named(tmp_path):
    rollouts, scores = write_policy_data(tmp_path)
    partial = read_frame(scores, "scores")
    write_artifact(str(tmp_path / "partial.parquet"), "scores", partial[partial["prompt_id"] != "p1"])
    with pytest.raises(ValueError, match=r"4 rollout\(s\) have no score.*p1"):
        train_policy(
            rollouts, str(tmp_path / "partial.parquet"), "tiny-random", str(tmp_path / "x"), TrainConfig()
        )
    rubrics, rewards = write_evaluator_data(tmp_path)
    r = read_frame(rewards, "rewards")
    r.loc[0, "r_anchor"] = None  # set0 now has r_anchor for some samples only
    write_artifact(str(tmp_path / "mixed.parquet"), "rewards", r)
    with pytest.raises(ValueError, match="set0.*some rubric samples"):
        train_evaluator(
            rubrics,
            str(tmp_path / "mixed.parquet"),
            "tiny-random",
            str(tmp_path / "y"),
            EvaluatorTrainConfig(),
        )
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        train_policy(rollouts, scores, "tiny-random", str(tmp_path / "z"), TrainConfig(world_size=2))


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_sigkill_mid_run_then_rerun_equals_uninterrupted(tmp_path, request, where):
    """A real SIGKILL to a real training process, then a rerun; on S3 the resumable state lives in the bucket."""
    rollouts, scores = write_policy_data(tmp_path)
    section = {**FAST, "micro_batch_size": 2, "save_every": 2}  # 6 steps per epoch, 12 in all
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump({"preset": "tiny", "train_policy": section}))
    out = (
        str(tmp_path / "killed")
        if where == "local"
        else f"s3://{request.getfixturevalue('s3_env')}/run/killed"
    )
    state_uri = store.join(out + ".work", "state.pt")
    cmd = [sys.executable, "-m", "dynamicrubric.train", "policy", "--data", rollouts, "--rewards", scores,
           "--model", "tiny-random", "--out", out, "--config", str(config_file)]  # fmt: skip

    proc = subprocess.Popen(
        cmd, env={**os.environ, STALL_ENV: "4"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # the hook prints this only after step 4's state is saved
            if "stalled after step 4" in line or time.monotonic() > deadline:
                break
        assert proc.poll() is None, "the stage ended before the stall point"
        assert store.exists(state_uri)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not store.is_complete(out) and not store.exists(store.join(out, "config.json"))

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resuming from step 4 of 12" in rerun.stderr
    assert store.is_complete(out) and not store.exists(state_uri)
    if where == "s3":  # compare through the same path a later stage takes: fetch the checkpoint by URI
        out = str(resolve_model_ref(out))

    reference = str(tmp_path / "uninterrupted")
    cfg = load_config(config_file).train_policy
    train_policy(rollouts, scores, "tiny-random", reference, cfg)
    assert_same_tensors(out, reference)
    # the resumed run's metrics cover all 12 steps, the ones before the kill included
    summary = json.loads((Path(out) / SUMMARY_FILE).read_text())
    assert sorted({r["step"] for r in summary["metrics_rows"]}) == list(range(1, 13))


def test_batched_logprobs_match_unpadded_forward():
    """Right padding, different prompt lengths and the trimmed LM head give each sequence's own log-probs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dynamicrubric.train import Example, _sequence_logprobs, _tokenize

    path = resolve_model("tiny-random")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    examples = [
        Example("g", "Hi", "The answer is 5.", True, 0.0, 0.0),
        Example(
            "g", "A much longer question about the quick brown fox and the lazy dog?", "no", False, 0.0, 0.0
        ),
        Example("g", "What is 4 + 4?", "", True, 0.0, 0.0),  # eos only
    ]
    data = _tokenize(examples, tok)
    with torch.no_grad():
        logp, mask = _sequence_logprobs(model, data, tok.pad_token_id, torch.device("cpu"))
    for i, (ex, t) in enumerate(zip(examples, data, strict=True)):
        expected = mean_logprob(path, [(ex.user_message, ex.completion, ex.add_eos)])
        n = len(t.completion_ids)
        assert mask[i].sum().item() == n and n == len(tok(ex.completion).input_ids) + ex.add_eos
        assert logp[i, :n].mean().item() == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
def test_fsdp_two_processes_match_one(tmp_path):
    """torchrun with 2 CPU ranks (gloo, FSDP2, LoRA + checkpointing) equals 1 process with 2x grad accumulation."""
    rollouts, scores = write_policy_data(tmp_path)
    common = {**FAST, "micro_batch_size": 2, "lora_rank": 4, "lora_alpha": 8, "gradient_checkpointing": True}
    outs = {}
    for world, accum in ((1, 2), (2, 1)):
        config_file = tmp_path / f"w{world}.yaml"
        section = {**common, "grad_accum": accum, "world_size": world}
        config_file.write_text(yaml.safe_dump({"preset": "tiny", "train_policy": section}))
        outs[world] = str(tmp_path / f"out{world}")
        launcher = (
            ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] if world > 1 else []
        )
        cmd = [sys.executable, *launcher, "-m", "dynamicrubric.train", "policy", "--data", rollouts,
               "--rewards", scores, "--model", "tiny-random", "--out", outs[world], "--config", str(config_file)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert store.is_complete(outs[world])
    one, two = tensors(outs[1]), tensors(outs[2])
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-5), k
    assert any(not torch.equal(t, tensors(resolve_model("tiny-random"))[k]) for k, t in one.items())


def test_examples_rewards_and_advantages(tmp_path):
    from dynamicrubric.grpo import group_advantages
    from dynamicrubric.train import evaluator_examples, policy_examples

    rollouts, scores = write_policy_data(tmp_path)
    ex = policy_examples(rollouts, scores, TrainConfig())
    # the shards of a fan-out read as one artifact
    frame = read_frame(rollouts, "rollouts")
    shards = [str(tmp_path / f"shard{i}.parquet") for i in range(2)]
    write_artifact(shards[0], "rollouts", frame[frame["prompt_id"] == "p1"])
    write_artifact(shards[1], "rollouts", frame[frame["prompt_id"] != "p1"])
    assert policy_examples(shards, [scores], TrainConfig()) == ex
    assert [e.reward for e in ex[:4]] == [1.0, 0.75, 0.25, 0.0]  # mean over the two rubric samples
    assert [e.add_eos for e in ex[:4]] == [True, False, True, False]  # eos only where generation stopped
    assert [e.group for e in ex] == ["p0"] * 4 + ["p1"] * 4 + ["p2"] * 4
    expected = group_advantages(torch.tensor([1.0, 0.75, 0.25, 0.0]), torch.zeros(4)).tolist()
    assert [e.advantage for e in ex[4:8]] == pytest.approx(expected)

    ev = evaluator_examples(*write_evaluator_data(tmp_path), EvaluatorTrainConfig(anchor_weight=0.5))
    g = torch.zeros(4)
    a_disc = group_advantages(torch.tensor([0.25, 0.2, 0.1, 0.0]), g)
    a_anchor = group_advantages(torch.tensor([-0.5, -1.0, -1.5, -3.0]), g)
    assert [e.advantage for e in ev[:4]] == pytest.approx((a_disc + 0.5 * a_anchor).tolist())  # set0: both
    assert [e.advantage for e in ev[4:]] == pytest.approx(a_disc.tolist())  # set1: no anchors, A_anchor = 0
    assert ev[0].user_message.startswith("Task 0") and ev[0].completion == RUBRIC_TEXTS[0]
