"""The config's sections about judging and evaluating: how a judge is named (`JudgeSpec`, wherever the config
asks for one), the signal guard, and the evaluate stage with its open-ended benchmarks. Apart from
config_sections.py, which holds the sections of models, engines, data, training and the pipeline: these
are the ones a new benchmark or guard check changes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from dynamicrubric.infra.config_sections import MAX_SAMPLES, Section


def _judge_url(value: str) -> str:
    if value and not value.startswith(("http://", "https://")):
        raise ValueError(
            f"expected an http:// or https:// base URL of an OpenAI-compatible server, got {value!r}"
        )
    return value.rstrip("/")


class JudgeSpec(Section):
    """A judge, named the same way wherever the config asks for one (the benchmarks' judge, the signal
    guard's gold): a model run in the task's process, or any OpenAI-compatible chat endpoint, asked
    yes/no questions (engines/chat_judge.py). Neither: the default that the key's comment names."""

    model: str = ""  # a model reference (folder, hub id, built-in name) run in the task's process
    # An OpenAI-compatible base URL, e.g. https://api.openai.com/v1 (GPT-4.1, as the paper's appendix
    # re-judges), a vLLM server's http://judge:8000/v1, a team's judge service.
    url: str = ""
    served_model: str = ""  # the model the endpoint is asked for ("gpt-4.1"); "": the one it serves
    api_key_env: str = ""  # the environment variable that holds the endpoint's key (the key never goes here)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return _judge_url(value)

    @model_validator(mode="after")
    def _one_judge(self) -> JudgeSpec:
        if self.model and self.url:
            raise ValueError("name the judge's model or its url, not both")
        if (self.served_model or self.api_key_env) and not self.url:
            raise ValueError("served_model and api_key_env name an endpoint's model and key: set url too")
        return self


CANARY_KINDS = ("padded", "master_key", "format_only", "empty", "restated")


class GuardConfig(Section):
    """The signal guard: every round's evaluate stage checks whether the round's evaluator can still be
    trusted (guard.py has the measures and the alarm's rules)."""

    # Off: no guard measures (the win rate still compares one sample of each policy), for a run that
    # cannot spare the evaluate stage's extra work.
    enabled: bool = True
    # What the alarm does: warn (a log line and an MLflow tag), stop (no later round runs), rollback (the
    # next round starts from the last healthy round's policy and generator).
    action: Literal["warn", "stop", "rollback"] = "warn"
    # The alarm fires when a share of canaries above this beats or ties its original ...
    canary_max: float = Field(0.2, ge=0, le=1)
    # ... or when the round's evaluator moves a response's score by more than this on average when the
    # same responses are shown to the generator in another order.
    order_max: float = Field(0.2, ge=0, le=1)
    # Held-out candidate sets that get canaries each round (0: no canaries), and which kinds: one canary
    # of each kind a set (3: each of guard.MASTER_KEYS once a round).
    canary_sets: int = Field(3, ge=0, le=MAX_SAMPLES)
    canary_kinds: list[Literal["padded", "master_key", "format_only", "empty", "restated"]] = list(
        CANARY_KINDS
    )
    order_audit: bool = True
    bootstrap: int = Field(1000, ge=100, le=100_000)  # resamples for the intervals
    # The gold of held-out prompts without a checker: this judge, asked pointwise ("is this response good
    # and correct?"). None named: the round-0 evaluator (the base generator's rubrics, judged by V).
    gold_judge: JudgeSpec = JudgeSpec()


class BenchmarkConfig(Section):
    """One open-ended benchmark of the paper's policy table, judged every round (evaluation/benchmarks.py)."""

    name: Literal["alpaca_eval", "arena_hard_v2", "writingbench"]
    prompts: int | None = Field(None, ge=1)  # a seeded subset of this many prompts; None: all of them
    file: str = ""  # a file of the same shape (JSONL or Parquet, local or s3://) instead of the package's
    # quick: one yes/no question per order, P(yes) thresholded (evaluation/benchmark_runs.py), labelled "not
    # comparable with the benchmark's leaderboard" wherever shown. official: the benchmark's own protocol
    # (evaluation/official_protocols.py: AlpacaEval 2's annotator, Arena-Hard v2.0's judge, WritingBench's critic).
    protocol: Literal["quick", "official"] = "quick"
    # AlpacaEval 2's df_gamed.csv (the instructions' difficulty and the gamed baselines its LC needs): a path,
    # "" for alpaca_eval's HF cache, "hub" to download it there. Without it the LC is reported as lc_minimal.
    df_gamed: str = ""
    # The most tokens a judge's reply may have where the official protocol has it write one; None: the
    # benchmark's own (Arena-Hard v2.0's judge 16,000, its answer and verdict; WritingBench's critic 2048).
    judge_max_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _settings_of_this_benchmark(self) -> BenchmarkConfig:
        if self.judge_max_tokens is not None and self.name == "alpaca_eval":
            raise ValueError(
                "alpaca_eval: judge_max_tokens is for a judge that writes; AlpacaEval 2's reads one token"
            )
        if self.df_gamed and self.name != "alpaca_eval":
            raise ValueError(f"{self.name}: df_gamed is AlpacaEval 2's file, not this benchmark's")
        return self


class EvaluateConfig(Section):
    variants: list[Literal["dynamic", "static", "pointwise"]] = ["dynamic", "static", "pointwise"]
    samples: int = Field(4, ge=1, le=MAX_SAMPLES)  # k for avg@k / pass@k
    sandbox_timeout_s: float = Field(10.0, gt=0)
    win_rate: bool = True
    # The open-ended benchmarks: P_t's and P_0's answers judged against the benchmark's baseline answers
    # and each other (evaluation/benchmark_runs.py). Their judge: none named, the frozen verifier V, never
    # the generator being trained; every table names it.
    benchmarks: list[BenchmarkConfig] = []
    benchmark_judge: JudgeSpec = JudgeSpec()
    benchmark_max_new_tokens: int = Field(512, ge=1)  # each answer's token budget
    benchmark_max_chars: int = Field(6000, ge=100)  # each text in a judge's question clipped at this length

    @field_validator("benchmarks")
    @classmethod
    def _each_once(cls, value: list[BenchmarkConfig]) -> list[BenchmarkConfig]:
        names = [b.name for b in value]
        if len(names) != len(set(names)):
            raise ValueError(f"each benchmark once, got {names}")
        return value
