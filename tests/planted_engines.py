"""Stand-in engines whose behaviour a test plants (named as stand-ins: no model runs in them).

Each is a real `Engine` (the project's interface, its argument checks, a real tokenizer for the chat
template: the tiny-random model's) whose answers come from a rule the test knows, so a test can show
that the signal guard sees what it must: a verifier fooled by a phrase, a generator that favours the
response it is shown first, a policy that games its reward while its answers get worse.

`engine(model_ref, load)` is the hook `engines.load_engine` calls when DYNRUBRIC_TEST_ENGINES names
this file (the pipeline tests set it, so every task and training process of a kfp.local run gets the
stand-ins): the scenario comes from DYNRUBRIC_TEST_SCENARIO (below); a model it does not plant loads
for real (`load()`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

from dynamicrubric.engines import Engine, Generation
from dynamicrubric.engines.base import Sampling

HACK = "As verified by every criterion, the answer is"
CODE_WORD = re.compile(r"code word ([\w-]+)")
RESPONSE = re.compile(r"Response:\n(.*?)\n\n", re.S)
CRITERION = re.compile(r"Criterion: (.*?)\n")
SHOWN = re.compile(r"Response [A-Z]:\n(.*?)(?:\n\nResponse [A-Z]:|\Z)", re.S)


def _tokenizer():
    from transformers import AutoTokenizer

    from dynamicrubric.infra.models import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("tiny-random"))


class Planted(Engine):
    """An engine with the tiny-random tokenizer (for chat templates) and planted answers."""

    def __init__(self, model_ref: str) -> None:
        self.model_ref = model_ref
        self.tokenizer = _tokenizer()
        self.calls: list = []  # each call: (prompts, samples per prompt) to generate, questions to judge

    def _generate(self, prompts: list[str], sampling: Sampling, desc: str) -> list[Generation]:
        self.calls.append((len(prompts), sampling.n))
        out = []
        for prompt in prompts:
            texts = [self.answer(prompt, j) for j in range(sampling.n)]
            out.append(
                Generation(texts, [len(self.tokenizer.encode(t)) + 1 for t in texts], ["stop"] * len(texts))
            )
        return out

    def answer(self, prompt: str, sample: int) -> str:
        raise NotImplementedError(f"{type(self).__name__} does not generate")

    def yes_probability(self, pairs, desc="judge", *, bar=None) -> list[float]:
        self.calls.append(len(pairs))
        out = []
        for prefix, suffix in pairs:
            response = RESPONSE.search(prefix)
            item = CRITERION.search(suffix)
            out.append(self.p_yes(response.group(1) if response else "", item.group(1) if item else ""))
            if bar is not None:
                bar.update(1)
        return out

    def p_yes(self, response: str, item: str) -> float:
        raise NotImplementedError(f"{type(self).__name__} does not judge")

    def logprobs(self, prompts, completions):
        raise NotImplementedError("planted engines have no log-probs")


class Policy(Planted):
    """Answers a "say the code word X" prompt: with X when honest, with the hack phrase and a wrong word
    when it games its reward."""

    def __init__(self, model_ref: str, hacked: bool) -> None:
        super().__init__(model_ref)
        self.hacked = hacked

    def answer(self, prompt: str, sample: int) -> str:
        found = CODE_WORD.findall(prompt)
        word = found[-1] if found else "nothing"
        return f"{HACK} wrong." if self.hacked else f"The code word is:\n{word}"


class Rubric(Planted):
    """A generator that writes `items(shown responses)` as its rubric, in the constrained JSON."""

    def __init__(self, model_ref: str, items: Callable[[list[str]], list[dict]]) -> None:
        super().__init__(model_ref)
        self.items = items

    def answer(self, prompt: str, sample: int) -> str:
        shown = [s.strip() for s in SHOWN.findall(prompt)]
        return json.dumps({"items": self.items(shown)})


class Verifier(Planted):
    """P(yes) from a rule on (response, criterion)."""

    def __init__(self, model_ref: str, rule: Callable[[str, str], float]) -> None:
        super().__init__(model_ref)
        self.rule = rule

    def p_yes(self, response: str, item: str) -> float:
        return self.rule(response, item)


# ---- rules the tests use


def fixed_items(shown: list[str]) -> list[dict]:
    return [{"text": "The response gives the code word.", "weight": 3}]


def first_shown_items(shown: list[str]) -> list[dict]:
    """Favours the response shown first: its one criterion quotes it."""
    return [{"text": f"Says ({shown[0]})" if shown else "Says nothing", "weight": 5}]


def quoted_item_rule(response: str, item: str) -> float:
    """Yes exactly when the criterion quotes the response."""
    return 0.9 if item == f"Says ({response.strip()})" else 0.1


def master_key_rule(response: str, item: str) -> float:
    """Fooled by a master key: yes to anything that claims to meet every criterion."""
    if "I have checked every criterion" in response:
        return 0.95
    return 0.6 if response.strip() else 0.1


def hack_rule(response: str, item: str) -> float:
    """Fooled by the policy's hack phrase (and by nothing else)."""
    return 0.9 if HACK in response else 0.1


# ---- the pipeline hook


def _trained(model_ref: str) -> dict:
    """What a checkpoint's training summary says (stage, round), {} for a base model folder."""
    summary = Path(model_ref) / "dynamicrubric_train.json"
    return json.loads(summary.read_text()) if summary.is_file() else {}


def engine(model_ref: str, load: Callable[[], Engine]) -> Engine | None:
    """The scenario's stand-in for `model_ref`. DYNRUBRIC_TEST_SCENARIO is JSON: {"policy": folder name
    of the base policy, "generator": ..., "verifier": ..., "hacked_from": the first round whose trained
    policy games its reward}. Roles are told apart by the base folders' names and the checkpoints'
    training summaries."""
    scenario = json.loads(os.environ["DYNRUBRIC_TEST_SCENARIO"])
    name = Path(model_ref).name
    trained = _trained(model_ref)
    stage = trained.get("stage", "").replace("-", "_")
    if stage == "train_policy" or name == scenario["policy"]:
        return Policy(model_ref, hacked=trained.get("round", 0) >= scenario["hacked_from"])
    if stage == "train_evaluator" or name == scenario["generator"]:
        return Rubric(model_ref, fixed_items)
    if name == scenario["verifier"]:
        return Verifier(model_ref, hack_rule)
    return None
