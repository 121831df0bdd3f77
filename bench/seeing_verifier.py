"""A stand-in verifier that sees the response, for `python -m bench.evaluator_learns --seeing-verifier`.

No model runs in it: it is a planted engine (named as one), loaded through the engines' test hook
(`DYNRUBRIC_TEST_ENGINES` names this file) for the verifier's model reference only; the policy and the
generator are the real SmolLM2. The 135M verifier's P(yes) hardly depends on the response, so R_disc
cannot rise whatever the generator writes and a broken generator trainer would go unnoticed; this one
answers from the response itself:

- an item that names a number: P(yes) 0.9 when the response contains that number, 0.1 when it does not;
- an item without a number: 0.5 (it tells no response apart).

So an item splits a candidate set exactly when it names a number some responses give and others do not
(on arithmetic prompts, one of the answers), and a generator that learns to write such items raises
R_disc. The rule is the whole verifier: what the bench measures is whether the trainer follows a reward
that can move, not what a real verifier would say.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from dynamicrubric.engines import Engine
from dynamicrubric.engines.base import Sampling

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
RESPONSE = re.compile(
    r"Response:\n(.*)\n\n\Z", re.S
)  # the judge's context ends the prefix; answers hold blank lines
CRITERION = re.compile(r"Criterion: (.*?)\n")
# The verifier's folder (the verifier model's files, linked): a stage hands the engines a local folder's
# path, so the hook knows V's requests by this name whatever the generator and the policy are.
FOLDER_NAME = "seeing-verifier"


def p_yes(response: str, item: str) -> float:
    named = set(NUMBER.findall(item))
    if not named:
        return 0.5
    return 0.9 if named & set(NUMBER.findall(response)) else 0.1


class SeeingVerifier(Engine):
    """P(yes) by `p_yes` on the (response, criterion) the judge's prompt holds; the real tokenizer's chat
    template, so the prompts are the ones the judge stage builds."""

    def __init__(self, model_ref: str, tokenizer) -> None:
        self.model_ref, self.tokenizer = model_ref, tokenizer

    def _generate(self, prompts: list[str], sampling: Sampling, desc: str):
        raise NotImplementedError("the seeing verifier only judges")

    def yes_probability(self, pairs, desc="judge", *, bar=None) -> list[float]:
        out = []
        for prefix, suffix in pairs:
            response, item = RESPONSE.search(prefix), CRITERION.search(suffix)
            out.append(p_yes(response.group(1) if response else "", item.group(1) if item else ""))
            if bar is not None:
                bar.update(1)
        return out

    def logprobs(self, prompts, completions):
        raise NotImplementedError("the seeing verifier has no log-probs")


def engine(model_ref: str, load: Callable[[], Engine]) -> Engine | None:
    """The engines' test hook: the seeing verifier for the verifier's reference, the real model otherwise."""
    if Path(model_ref).name != FOLDER_NAME:
        return None
    from transformers import AutoTokenizer

    from dynamicrubric.infra.models import resolve_model

    return SeeingVerifier(model_ref, AutoTokenizer.from_pretrained(resolve_model(model_ref)))
