"""Trainer checkpoints.

Checkpoints and resume. TRL saves a trainer checkpoint every `save_steps` steps in a local scratch
folder; a callback uploads it to `<out>.work/checkpoint-NNNNN` in the store (`_COMPLETE` last; for a
pod path /s3/b/k that is s3://b/k.work, since the pod's mount is uploaded only when the task succeeds)
with the starting model and a digest of the train config beside it, so a retried pod on another node
resumes from the newest complete one and ends with the same weights as an uninterrupted run; a
checkpoint of another model or config, or one past `max_steps`, is refused; one at `max_steps` (the task
was lost in the export) is resumed with no step left, and exported. The result is a
Hugging Face folder (LoRA merged, plus a summary JSON) written to `out_uri` with `store.upload_dir`:
every rank takes part in gathering the weights (a collective under FSDP), rank 0 writes them. A stage
whose output is complete does nothing, once checked that it holds the same work (`already_done`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dynamicrubric import store
from dynamicrubric.infra.artifacts import write_artifact
from dynamicrubric.infra.config import Config, TrainConfig
from dynamicrubric.training import cpu_waits
from dynamicrubric.training.data import TrainingJob, trainee

log = logging.getLogger(__name__)


SUMMARY_FILE = "dynamicrubric_train.json"


RESUME_INFO = "dynamicrubric_resume.json"  # beside each stored trainer checkpoint: the run that wrote it


# Test hook: with DYNRUBRIC_TEST_STALL_AFTER_STEP=k the process prints "stalled after step k" and sleeps
# once the step-k trainer checkpoint is in the store, so a test can kill it provably mid-run.
STALL_ENV = "DYNRUBRIC_TEST_STALL_AFTER_STEP"


def work_prefix(out_uri: str) -> str:
    """Where the resumable trainer checkpoints go: `<out>.work`, in the object store itself when
    `out_uri` is a pod's path to it (/s3/b/k is s3://b/k). The pod path is pod-local and uploaded only
    when the task succeeds, so a retried pod would never see checkpoints written there."""
    from dynamicrubric.infra.tracking import POD_PREFIXES, artifact_uri

    base = out_uri.rstrip("/")
    if base.startswith(tuple(POD_PREFIXES)) and store.is_s3(artifact_uri(base)):
        base = artifact_uri(base)
    return base + ".work"


def scratch_folder(out_uri: str) -> Path:
    """Local folder for TRL's output_dir: beside a local output, in the cache when the trainer
    checkpoints go to the object store (the cache is node-local scratch; a retried pod gets a new one)."""
    work_uri = work_prefix(out_uri)
    if store.is_s3(work_uri):
        from dynamicrubric.infra.models import cache_dir

        return cache_dir() / "train-work" / hashlib.sha256(work_uri.encode()).hexdigest()[:16]
    return store.local_path(work_uri) / "scratch"


def checkpoint_origin(model_ref: str, tcfg: TrainConfig) -> dict[str, str]:
    """What a stored trainer checkpoint records about the run that wrote it, compared on resume: the
    starting model, and a digest of the train config without `max_steps` (raising it continues a run;
    the zero-steps check covers lowering it)."""
    from dynamicrubric.infra.model_references import model_reference

    config = tcfg.model_dump(mode="json")
    config.pop("max_steps")
    config.pop("process_group_timeout_s")  # how long to wait, not what is trained
    config.pop("wait_timeout_s")
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    return {"model_ref": model_reference(model_ref), "config_digest": digest}


def stored_checkpoints(work_uri: str) -> list[str]:
    names = {
        rel.split("/")[0]
        for rel in (
            f.removeprefix(work_uri.rstrip("/") + "/")
            for f in store.list_files(work_uri)
            if not f.endswith("/scratch") and "/scratch/" not in f
        )
        if rel.startswith("checkpoint-")
    }
    return sorted(n for n in names if store.is_complete(store.join(work_uri, n)))


def resume_point(stage: str, work_uri: str, origin: dict, steps: int) -> str | None:
    """The newest complete stored checkpoint, once checked that it belongs to this run (same model and
    train config) and leaves steps to train; None when there is none."""
    done = stored_checkpoints(work_uri)
    if not done:
        return None
    name = done[-1]
    uri = store.join(work_uri, name)
    try:
        recorded = json.loads(store.read_bytes(store.folder_file(uri, RESUME_INFO)))
    except store.StoreError:
        raise ValueError(
            f"{stage}: the trainer checkpoint {uri} does not record the model and config it was trained "
            f"with, so it cannot be resumed safely: delete {work_uri} to start over"
        ) from None
    if recorded != origin:
        raise ValueError(
            f"{stage}: the trainer checkpoint {uri} was written for model {recorded.get('model_ref')!r} with "
            f"train config {recorded.get('config_digest')}, not for this run's model {origin['model_ref']!r} "
            f"with train config {origin['config_digest']}: delete {work_uri} to start over"
        )
    step = int(name.removeprefix("checkpoint-"))
    if step > steps:
        raise ValueError(
            f"{stage}: the trainer checkpoint {uri} is at step {step} and the config asks for max_steps={steps}: "
            f"it is trained past the config; raise max_steps, or delete {work_uri} to start over"
        )
    # At step == max_steps (transformers always saves the last step) the run was lost after training,
    # in the export: the trainer resumes, trains no step, and the export runs from this checkpoint.
    return uri


def node_part(uri: str, node: int) -> str:
    """Where node `node` (> 0) of a several-node job keeps its ranks' files of checkpoint `uri`: each node
    writes its own processes' files (their RNG states, FSDP's sharded optimizer state) on its own disk,
    which rank 0 cannot upload."""
    work, name = uri.rstrip("/").rsplit("/", 1)
    return store.join(work, "nodes", f"node-{node}", name)


def this_node() -> int:
    """This process's node in the launch (torchrun's GROUP_RANK; 0 when it runs alone)."""
    return int(os.environ.get("GROUP_RANK", "0"))


@functools.cache
def replicated_entries_with_rank0() -> None:
    """Make DCP save every replicated entry of a trainer checkpoint with rank 0, whose files every node
    fetches on resume (`fetch_checkpoint`). Once a process, before its first save.

    DCP writes an entry that several ranks hold (AdamW's per-parameter `step` tensors, the optimizer's
    `param_groups` values: plain tensors and values, not DTensor shards) once, on the rank that has
    written the fewest bytes so far: `DefaultSavePlanner(dedup_save_to_lowest_rank=False)`, torch's
    default (torch/distributed/checkpoint/_dedup_save_plans.py `dedup_save_plans`). So they spread over
    the ranks of every node, and node 0, which fetches only its own files, could not load its optimizer
    (FileNotFoundError on `optimizer_0/__1_0.distcp`, on every retry). With `True` each goes to the
    lowest rank that holds it: rank 0 for everything an FSDP2 mesh replicates, while each rank's shards
    stay in its own file. accelerate 1.15 builds `DefaultSavePlanner()` with no arguments, importing it
    from torch's module at each save (utils/fsdp_utils.py `save_fsdp_model`, `save_fsdp_optimizer`), so
    that module's name is where the default can change; tests/test_fsdp_nodes.py checks where the
    entries land and that two nodes resume."""
    from torch.distributed.checkpoint import default_planner

    base = default_planner.DefaultSavePlanner

    class ReplicatedWithRank0(base):
        def __init__(self, *args, dedup_save_to_lowest_rank: bool = True, **kwargs) -> None:
            super().__init__(*args, dedup_save_to_lowest_rank=dedup_save_to_lowest_rank, **kwargs)

    default_planner.DefaultSavePlanner = ReplicatedWithRank0


def fetch_checkpoint(uri: str, scratch: Path) -> str:
    """A stored trainer checkpoint in the scratch folder (a local one is read where it is), with this
    node's own part of it beside rank 0's on a node other than the first."""
    local = scratch / uri.rstrip("/").rsplit("/", 1)[-1]
    marker = local / store.COMPLETE_MARKER
    stored = store.read_manifest(uri)
    # Every process of a node resumes from one copy: the first downloads it, the others find it here.
    if not (marker.is_file() and stored and json.loads(marker.read_text()).get("token") == stored["token"]):
        shutil.rmtree(local, ignore_errors=True)
        log.info("resuming from %s", uri)
        if this_node() > 0:
            store.download_dir(node_part(uri, this_node()), local)
        local = store.download_dir(uri, local)  # its marker last: the reuse check above reads it
    return str(local)


def checkpoint_callback(work_uri: str, origin: dict):
    from transformers import TrainerCallback

    class UploadCheckpoints(TrainerCallback):
        """Copy each trainer checkpoint to the store (complete or absent), with the run's origin
        beside it for the resume check, then drop older ones. Every process calls on_save and uploads a
        share of its node's files, so a save takes the node's streams, not one process's; each node's
        first process publishes its node's part once its shares are in, and rank 0 publishes the
        checkpoint, its marker last, once every other node's part is published."""

        def on_save(self, args, state, control, **kwargs):
            local = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            name = f"checkpoint-{state.global_step:05d}"
            uri = store.join(work_uri, name)
            if state.is_world_process_zero:
                (local / RESUME_INFO).write_text(json.dumps(origin, indent=1))
            cpu_waits.barrier()  # every process's files are written (its RNG state comes after the model)
            node = this_node()
            stored = uri if node == 0 else node_part(uri, node)
            version = upload_shares(local, stored, args.process_index, node)
            if version is not None and node > 0:
                store.publish_version(stored, *version)
            cpu_waits.barrier()  # every other node's part is stored
            if state.is_world_process_zero:
                store.publish_version(uri, *version)
                for old in stored_checkpoints(work_uri):
                    if old != name:
                        store.delete_dir(store.join(work_uri, old))
                nodes = store.join(work_uri, "nodes")  # the other nodes' parts: node-K/checkpoint-NNNNN
                files = store.list_files(nodes)
                for part in {"/".join(f.split("/")[:2]) for f in files if f.count("/") >= 2}:
                    if not part.endswith("/" + name):
                        store.delete_dir(store.join(nodes, part))
            # The checkpoint is stored: no rank goes on into the next step's collectives before that.
            cpu_waits.barrier()
            if state.is_local_process_zero:
                shutil.rmtree(local, ignore_errors=True)
            if not state.is_world_process_zero:
                return
            if os.environ.get(STALL_ENV) == str(state.global_step):
                print(f"stalled after step {state.global_step}", flush=True)
                while True:
                    time.sleep(3600)

    return UploadCheckpoints()


def upload_shares(local: Path, uri: str, rank: int, node: int) -> tuple[str, dict] | None:
    """Every process of the job uploads its share of its node's checkpoint folder `local` into one
    unpublished version of `uri` (the node's); every rank must call this. Returns, on the node's first
    process, the version's token and the entries of all its files, to publish; None on the others."""
    everyone = cpu_waits.gather_object((node, store.new_token()))
    ranks = [r for r, (n, _) in enumerate(everyone) if n == node]  # this node's processes, in rank order
    token = everyone[ranks[0]][1]
    share = writer_share(store.folder_files(local), len(ranks), ranks.index(rank))
    entries = cpu_waits.gather_object(store.upload_version(share, uri, token))  # also: all are done
    if rank != ranks[0]:
        return None
    return token, {rel: entry for r in ranks for rel, entry in entries[r].items()}


def writer_share(files: dict[str, Path], writers: int, index: int) -> dict[str, Path]:
    """Writer `index`'s part of `files`: the biggest file first to the writer with the fewest bytes so far.
    Every writer computes the same split from the same listing, and the bytes come out nearly even
    (each rank's DCP shards are about the same size, so each rank sends about its own)."""
    loads, owner = [0] * writers, {}
    for rel, path in sorted(files.items(), key=lambda item: (-item[1].stat().st_size, item[0])):
        owner[rel] = loads.index(min(loads))
        loads[owner[rel]] += path.stat().st_size
    return {rel: path for rel, path in files.items() if owner[rel] == index}


def finished_work(cfg: Config, job: TrainingJob) -> dict:
    """What a finished checkpoint records about the work that made it, compared before it is reused:
    the stage and round, the trained model and the reward's models (as model_reference spells them), a
    digest of the config (all but `pipeline` and the models' references and URLs, which say where a
    run is orchestrated and served, not what it computes; the trainer's section with its max_steps
    included) and the input artifacts (their canonical URIs)."""
    from dynamicrubric.infra.model_references import model_reference
    from dynamicrubric.infra.tracking import artifact_uri

    config = cfg.model_dump(mode="json")
    config.pop("pipeline")
    # The models are the job's (recorded below); a reward model's URL is where it is served (a training
    # process gets its own servers' URLs), not what it computes.
    for key in ("policy", "generator", "verifier", "generator_url", "verifier_url"):
        config["models"].pop(key)
    inputs = [job.prompts_uri, *job.candidates, *job.anchors]
    return {
        "stage": job.stage,
        "round": job.round_idx,
        "model_ref": model_reference(job.model_ref),
        "models": {
            role: model_reference(ref) for role in ("generator", "verifier") if (ref := getattr(job, role))
        },
        "config_digest": hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16],
        "inputs": [store.canonical(artifact_uri(u)) for u in inputs if u],
    }


def _other_work(summary: dict, work: dict, tcfg: TrainConfig) -> list[str]:
    """How the work recorded in a finished checkpoint's summary differs from `work` (none: the same).
    A summary from before `work` was recorded is compared on what it has: stage, round, model, train
    config."""
    from dynamicrubric.infra.model_references import model_reference

    recorded = summary.get("work")
    if recorded is None:
        recorded = {k: summary[k] for k in ("stage", "round") if k in summary}
        if "model_ref" in summary:
            recorded["model_ref"] = model_reference(summary["model_ref"])
        if "config" in summary and summary["config"] != tcfg.model_dump(mode="json"):
            recorded["config_digest"] = "(an older one)"
    differ = [k for k in work if k in recorded and recorded[k] != work[k]]
    what = {
        "stage": lambda a, b: f"written by {a}, not {b}",
        "round": lambda a, b: f"round {a}, not {b}",
        "model_ref": lambda a, b: f"trained from {a!r}, not {b!r}",
        "models": lambda a, b: f"rewarded by {a}, not {b}",
        "config_digest": lambda a, b: f"config {a}, not {b}",
        "inputs": lambda a, b: "other inputs",
    }
    return [what[k](recorded[k], work[k]) for k in differ]


def already_done(cfg: Config, job: TrainingJob) -> dict:
    """The recorded result of a finished checkpoint at the job's output, once checked that it is the
    same work as the job's: another model, config or input set would be passed off as this run's."""
    out_uri = job.out_uri
    try:  # through the folder's manifest: on S3 its files live under the writer's version
        summary_uri = store.folder_file(out_uri, SUMMARY_FILE)
    except store.StoreError:
        raise ValueError(
            f"{job.stage}: {out_uri} holds a complete model folder that no training run wrote (no "
            f"{SUMMARY_FILE}); it is not taken as this run's result: write to another path, or delete it"
        ) from None
    summary = json.loads(store.read_bytes(summary_uri))
    other = _other_work(summary, finished_work(cfg, job), trainee(cfg, job.stage).tcfg)
    if other:
        raise ValueError(
            f"{job.stage}: {out_uri} holds a finished checkpoint of other work ({'; '.join(other)}); it is "
            "not reused: write to another path, or delete it to train again"
        )
    log.info("%s: checkpoint already complete; nothing to do", out_uri)
    if job.metrics_uri and not store.exists(job.metrics_uri):
        write_artifact(job.metrics_uri, "metrics", summary["metrics_rows"])
    return {**summary["final"], "timings": []}  # nothing was measured this time


def lora_config(tcfg: TrainConfig):
    from peft import LoraConfig

    return LoraConfig(
        r=tcfg.lora_rank,
        lora_alpha=tcfg.lora_alpha,
        lora_dropout=0.0,
        target_modules="all-linear",
        task_type="CAUSAL_LM",
    )


def saved_dtype(path: Path) -> torch.dtype:
    """The dtype the starting checkpoint was stored in; the trained one is saved the same way."""
    config = json.loads((path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def gather_weights(trainer) -> dict[str, torch.Tensor]:
    """The trained model's full state dict; every rank must call this. Under FSDP2 it is a collective
    (each rank sends its shards, rank 0 receives the whole model, the others get nothing), so a call on
    rank 0 alone waits forever for ranks that already wait at the end-of-training barrier.

    accelerate runs FSDP only on accelerators (its FSDP type is set for MULTI_GPU/XPU/NPU/..., never
    MULTI_CPU); tests/test_fsdp_cpu.py runs this sharded on two CPU processes through the test hook of
    training/fsdp_hook.py, and checks that it runs on every rank by the line it logs."""
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    log.info(
        "rank %d: gathered the trained weights (%d tensors here)",
        trainer.accelerator.process_index,
        len(state_dict),
    )
    return state_dict


def write_checkpoint(weights, path, tcfg, tokenizer, job, final: dict, rows: list[dict], work: dict) -> None:
    """A plain HF folder: the trained model (LoRA merged in) in the starting dtype, and a summary (with
    the `work` that made it, see finished_work).

    Rank 0 alone, so nothing here may be a collective: the gathered weights are loaded into a fresh
    copy of the starting model on the CPU (never the sharded module, whose merge or dtype change would
    need the other ranks), and LoRA is merged there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=saved_dtype(path))
    if tcfg.lora_rank:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(tcfg))
    model.load_state_dict(weights)  # strict: a key the trainer's model had and this one lacks is an error
    if tcfg.lora_rank:
        model = model.merge_and_unload()
    with tempfile.TemporaryDirectory(dir=scratch_folder(job.out_uri).parent) as tmp:
        folder = Path(tmp) / "export"
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        summary = {
            "stage": job.stage,
            "round": job.round_idx,
            "model_ref": job.model_ref,
            "config": tcfg.model_dump(mode="json"),
            "work": work,
            "final": final,
            "metrics_rows": rows,
        }
        (folder / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
        store.upload_dir(folder, job.out_uri)  # _COMPLETE last
    log.info("%s: wrote checkpoint %s", job.stage, job.out_uri)
