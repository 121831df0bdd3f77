"""What every engine shares: the `Engine` interface, a generation's result, per-sample seeds, the
yes/no label tokens and P(yes) arithmetic, progress bars and argument checks (see engines/__init__.py)."""

from __future__ import annotations

import abc
import contextlib
import gc
import hashlib
import logging
import math
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

# Single-token spellings counted as a "yes" / "no" answer; those the tokenizer lacks are skipped.
YES_SPELLINGS = ("yes", "Yes", "YES", " yes", " Yes", " YES")
NO_SPELLINGS = ("no", "No", "NO", " no", " No", " NO")


class EngineError(RuntimeError):
    """Bad input to an engine, or a model/tokenizer the engine cannot use; the message says which."""


_PROMPT_INDEX = re.compile(r"\bprompt (\d+)\b")


@contextlib.contextmanager
def prompts_named(ids: Sequence[object]) -> Iterator[None]:
    """An engine names a bad prompt by its place in the list it was given ("prompt 0"), which the user
    cannot find in their data: inside this block an EngineError names it by its id, `ids[i]`."""
    try:
        yield
    except EngineError as e:
        text = str(e)

        def named(m: re.Match) -> str:
            i = int(m.group(1))
            return f"prompt {str(ids[i])!r}" if i < len(ids) else m.group(0)

        renamed = _PROMPT_INDEX.sub(named, text, count=1)
        if renamed == text:
            raise
        raise EngineError(renamed) from None


@dataclass
class Generation:
    """The n samples for one prompt. `num_tokens` counts generated tokens, the stop token included."""

    texts: list[str]
    num_tokens: list[int]
    finish_reasons: list[str]  # "stop" | "length"


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one sample's random stream, derived from (seed, prompt index, sample index)."""
    digest = hashlib.sha256(f"{seed}:{prompt_index}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def answer_token_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids of the single-token spellings of yes and of no (errors if either set is empty)."""

    def ids(spellings: tuple[str, ...]) -> list[int]:
        out: list[int] = []
        for s in spellings:
            toks = tokenizer.encode(s, add_special_tokens=False)
            if len(toks) == 1 and toks[0] not in out:
                out.append(toks[0])
        return out

    yes, no = ids(YES_SPELLINGS), ids(NO_SPELLINGS)
    if not yes or not no or set(yes) & set(no):
        raise EngineError(
            f"tokenizer has no usable single-token yes/no spellings (yes ids {yes}, no ids {no})"
        )
    return yes, no


# Progress bars refresh at most this often when stderr is not a terminal (kfp.local and pod logs:
# kfp.local reads task output in text mode, so each refresh becomes one log line).
PROGRESS_INTERVAL_S = 5.0


def progress_bar(total: int, desc: str, unit: str) -> Any:
    """A tqdm bar on stderr with counts and a rate; kept when done, so the log shows the final rate."""
    from tqdm.auto import tqdm

    interactive = sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=sys.stderr,
        mininterval=0.5 if interactive else PROGRESS_INTERVAL_S,
        disable=total == 0,
        dynamic_ncols=interactive,
    )


def bar_or(bar: Any, total: int, desc: str) -> Any:
    """The caller's bar (left open for the caller to close), or a new one closed on exit."""
    if bar is None:
        return progress_bar(total, desc, "judgment")
    return contextlib.nullcontext(bar)


def check_pairs(pairs: list[tuple[str, str]]) -> None:
    for i, p in enumerate(pairs):
        if not (isinstance(p, tuple | list) and len(p) == 2 and all(isinstance(s, str) for s in p)):
            raise EngineError(
                f"yes_probability: pair {i} must be a (prefix, suffix) pair of strings, got {p!r}"
            )


@dataclass(frozen=True)
class Sampling:
    """One `generate` call's sampling settings, checked once here so that no engine repeats the checks."""

    n: int  # samples per prompt
    temperature: float  # 0: greedy
    top_p: float
    max_new_tokens: int
    seed: int
    rubric_items: int | None  # M: constrain each sample to `constrained.rubric_schema(M)`
    # Each prompt's index in the seeds (default its place in the list): a part of a larger batch,
    # sampled on its own, passes the prompts' places in the whole so each samples as it would there.
    prompt_indices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise EngineError(f"generate: n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise EngineError(f"generate: temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise EngineError(f"generate: top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise EngineError(f"generate: max_new_tokens must be >= 1, got {self.max_new_tokens}")

    def seed_of(self, prompt: int, sample: int) -> int:
        """The seed of sample `sample` of the `prompt`-th prompt of the call (engines.sample_seed)."""
        index = prompt if self.prompt_indices is None else self.prompt_indices[prompt]
        return sample_seed(self.seed, index, sample)


class Engine(abc.ABC):
    """What every backend offers. Prompts are raw strings, already templated with `chat_prompt`.

    A backend implements `_generate`, `yes_probability` and `logprobs`; `generate` itself lives here,
    so its keyword signature, defaults and argument checks are written once for every backend."""

    model_ref: str
    tokenizer: Any  # PreTrainedTokenizerBase
    # What an in-process engine does with a prompt longer than its context (`fit_prompt`).
    context_length: int | None = None
    long_prompts: str = "error"  # "error" | "truncate" (engine.long_prompts)
    truncated_prompts = 0  # how many prompts were cut to fit the context, over this engine's life

    def fit_prompt(self, ids: list[int], room: int, what: str) -> list[int]:
        """`ids` cut to leave `room` tokens of the context free, or an error, as `long_prompts` says. Checked
        before any forward pass: a 4 MB prompt would otherwise try to allocate many GB of attention, and
        vLLM would fail the whole batch (so a retry of the same seeded batch fails again)."""
        if self.context_length is None or len(ids) + room <= self.context_length:
            return ids
        keep = self.context_length - room
        if self.long_prompts == "error" or keep < 1:
            raise EngineError(
                f"{what} has {len(ids)} tokens; with {room} more it exceeds the context length "
                f"{self.context_length} of {self.model_ref!r} (engine.long_prompts: truncate cuts it instead)"
            )
        self.truncated_prompts += 1
        log.warning(
            "%s: %d tokens cut to its last %d to fit the context of %s (%d prompt(s) truncated so far)",
            what,
            len(ids),
            keep,
            self.model_ref,
            self.truncated_prompts,
        )
        return ids[-keep:]

    def chat_prompt(self, messages: list[dict], *, enable_thinking: bool | None = None) -> str:
        """The model's chat template applied to `messages`, ending where the assistant's turn begins.

        `enable_thinking` is passed to the template when not None (Qwen3-style templates read it;
        templates that do not know it ignore it); None leaves the template's default."""
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise EngineError(
                f"chat_prompt: expected a non-empty list of {{role, content}} dicts, got {messages!r}"
            )
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise EngineError(f"chat_prompt: the tokenizer of {self.model_ref!r} has no chat template")
        extra = {} if enable_thinking is None else {"enable_thinking": bool(enable_thinking)}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )

    def generate(
        self,
        prompts: list[str],
        n: int = 1,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 128,
        seed: int = 0,
        desc: str = "generate",
        rubric_items: int | None = None,
        prompt_indices: Sequence[int] | None = None,
    ) -> list[Generation]:
        """n samples per prompt; with `rubric_items=M` each sample is constrained to
        `constrained.rubric_schema(M)` (only a sample cut by max_new_tokens can be incomplete).
        `prompt_indices`: each prompt's index for its seeds (default 0, 1, ...; see Sampling).
        The settings are checked before anything else, so bad ones fail even with no prompts."""
        indices = None if prompt_indices is None else tuple(int(i) for i in prompt_indices)
        if indices is not None and len(indices) != len(prompts):
            raise EngineError(f"generate: {len(indices)} prompt_indices for {len(prompts)} prompts")
        sampling = Sampling(n, temperature, top_p, max_new_tokens, seed, rubric_items, indices)
        if not prompts:
            return []
        return self._generate(prompts, sampling, desc)

    @abc.abstractmethod
    def _generate(self, prompts: list[str], sampling: Sampling, desc: str) -> list[Generation]:
        """The backend's part of `generate`: samples for a non-empty list of prompts, settings checked;
        `desc` names the progress bar."""

    def close(self) -> None:
        """Free the model's memory (the engine is unusable afterwards). Idempotent."""
        free_memory()

    @abc.abstractmethod
    def yes_probability(
        self, pairs: list[tuple[str, str]], desc: str = "judge", *, bar: Any = None
    ) -> list[float]:
        """P(yes) / (P(yes) + P(no)) of the next token after prefix + suffix, per (prefix, suffix) pair;
        NaN where it cannot be computed. `bar`: a progress bar to advance instead of opening one."""

    @abc.abstractmethod
    def logprobs(self, prompts: list[str], completions: list[str]) -> list[list[float]]: ...


def free_memory() -> None:
    """Collect the Python objects of a released model and give cached GPU blocks back to the driver."""
    gc.collect()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def pair_token_ids(tokenizer: Any, pairs: list[tuple[str, str]]) -> list[list[int]]:
    """Each (prefix, suffix) pair, checked, as the token ids of prefix + suffix, encoded without special
    tokens. The questions about one response come together: its prefix is encoded once (the last kept)."""
    check_pairs(pairs)
    out: list[list[int]] = []
    prefix_ids: dict[str, list[int]] = {}
    for k, (p, s) in enumerate(pairs):
        if p not in prefix_ids:
            prefix_ids = {p: tokenizer.encode(p, add_special_tokens=False)}
        suffix = tokenizer.encode(s, add_special_tokens=False)
        if not suffix:
            raise EngineError(
                f"yes_probability: pair {k} has an empty suffix (it must hold at least one token)"
            )
        out.append(prefix_ids[p] + suffix)
    return out


def logsumexp(values: list[float]) -> float:
    if not values:
        return -math.inf
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))
