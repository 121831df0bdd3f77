"""How a request to a model server ends, counted: the outcomes a request can have, the ledger that gives
each request exactly one, the error of a server that lost too many, and the one-line text of their
counts. Apart from server_engine.py because the stages that call a server (the judge, the training
rewards) read and report these counts without needing the client itself."""

from __future__ import annotations

from dataclasses import dataclass

# finish_reason of a sample whose request failed after every retry: it has no text, and the stage that
# asked for it decides (the reward leaves its group out, a standalone stage stops).
FAILED = "failed"

# How a request can end: its answer was used (ok), or it was lost, and why.
OUTCOMES = ("ok", "timeout", "unreachable", "http_error", "malformed", "missing_label_tokens", "aborted")


@dataclass
class CallLedger:
    """What happened to every request sent to one server: each request ends in exactly one outcome."""

    ok: int = 0
    timeout: int = 0  # no complete answer within its bound (request_timeout_s, or the step's budget)
    unreachable: int = 0  # no connection, or the connection lost before a complete answer
    http_error: int = 0  # an HTTP error: a 4xx at once, a 429/5xx still at the deadline
    malformed: int = 0  # a 200 whose body is not the reply vLLM writes (truncated, fields missing, NaN)
    missing_label_tokens: int = 0  # a judge reply without every yes/no label's log-probability
    aborted: int = 0  # the server aborted the request (finish_reason "abort" or none)
    retries: int = 0  # extra tries after transient failures, over all requests
    lost_prompts: int = 0  # prompts of failed requests (their verdicts NaN, their samples FAILED)

    @property
    def failed(self) -> int:
        return sum(getattr(self, k) for k in OUTCOMES if k != "ok")

    def snapshot(self) -> CallLedger:
        return CallLedger(**vars(self))

    def since(self, before: CallLedger) -> dict[str, int]:
        """The counts added since `before` (a snapshot), by outcome."""
        return {k: v - getattr(before, k) for k, v in vars(self).items()}


class ServedError(RuntimeError):
    """A model server that lost requests past what the caller accepts. The message is one line naming
    the role, the server's URL, the requests' counts by outcome and where their record is; it is printed
    whole (never cut, never called an internal error)."""


def counts_text(counts: dict[str, float]) -> str:
    """'ok 3, timeout 2, lost_prompts 8': the non-zero counts of a ledger (or its `calls_*` metrics)."""
    order = (*OUTCOMES, "retries", "lost_prompts")
    named = {k.split("/")[-1].removeprefix("calls_"): v for k, v in counts.items() if v}
    parts = [f"{k} {int(named[k])}" for k in sorted(named, key=lambda k: (order + (k,)).index(k))]
    return ", ".join(parts) or "no requests"
