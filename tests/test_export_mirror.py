"""A multi-node trainer's export as the next task's pod receives it.

The task of a stage on several nodes publishes its export by server-side copies (training/on_nodes.py
`copy_outputs`, store `copy_dir`), versioned: the files under `<folder>/_versions/<token>/`, the
`_COMPLETE` marker (layout "versioned") beside them. KFP's launcher mirrors every key under an input
artifact's prefix into the next task's pod at its relative path (tests/pod_launcher.py
`download_artifact`), so the pod's path holds the marker and the version, not a flat model folder.
The next stage must load it from there, as it loads any other folder artifact.
"""

from __future__ import annotations

import json
import shutil

import pytest
from pod_launcher import download_artifact

from dynamicrubric import cli, store
from dynamicrubric.infra import tracking
from dynamicrubric.infra.artifacts import read_frame, write_artifact
from dynamicrubric.infra.model_references import follow_reference, write_reference
from dynamicrubric.infra.models import ModelError, prepare_model, resolve_model
from dynamicrubric.training.data import TrainingJob
from dynamicrubric.training.on_nodes import copy_outputs

PROMPTS = [
    {
        "prompt_id": f"p{i}",
        "task": "basic_arithmetic",
        "prompt": f"What is {i} + {i + 2}? Give only the final answer.",
        "reference": str(2 * i + 2),
        "meta": None,
    }
    for i in range(2)
]


@pytest.fixture
def pod(tmp_path, monkeypatch):
    """The next task's pod: its /s3 mount (where the launcher puts s3:// artifacts) under tmp_path,
    mapped back to the store's URIs as `tracking.POD_PREFIXES` maps /s3/b/k."""
    mount = tmp_path / "pod" / "s3"
    mount.mkdir(parents=True)
    monkeypatch.setattr(tracking, "POD_PREFIXES", {f"{mount}/": "s3://", **tracking.POD_PREFIXES})
    return mount


def _export(bucket: str, name: str) -> str:
    """A trained model as a multi-node stage's task publishes it: the nodes' export in the stage's work
    prefix, copied to the task's output URI by `copy_outputs` (the real code, server-side)."""
    out = f"s3://{bucket}/{name}/policy"
    nodes = TrainingJob("train-policy", f"{out}.work/trainjob/out", f"{out}.work/trainjob/steps")
    store.upload_dir(prepare_model("tiny-random"), nodes.out_uri)
    copy_outputs(nodes, TrainingJob("train-policy", out, f"s3://{bucket}/{name}/steps"))
    return out


def _rollout(prompts: str, out: str, policy: str) -> None:
    argv = ["stage", "rollout", "--preset", "tiny", "--prompts", prompts, "--out", out, "--policy", policy]
    assert cli.main([*argv, "--seed", "3"]) == 0


def test_the_next_stage_rolls_out_a_multi_node_export_the_launcher_mirrored(s3_env, pod, tmp_path):
    """Rollout with the export as its policy, at the pod path the launcher filled: the same responses
    as the same weights loaded by name, and the rollouts name the export by its store URI."""
    out = _export(s3_env, "r1")
    assert store.read_manifest(out)["layout"] == "versioned"
    mirror = pod / out.removeprefix("s3://")
    download_artifact(out, mirror)
    token = store.read_manifest(out)["token"]
    assert sorted(p.name for p in mirror.iterdir()) == [store.COMPLETE_MARKER, store.VERSIONS_DIR]
    assert (mirror / store.VERSIONS_DIR / token / "config.json").is_file()

    prompts = str(tmp_path / "prompts.parquet")
    write_artifact(prompts, "prompts", PROMPTS)
    _rollout(prompts, str(tmp_path / "mirrored.parquet"), str(mirror))
    _rollout(prompts, str(tmp_path / "by-name.parquet"), "tiny-random")
    mirrored = read_frame(str(tmp_path / "mirrored.parquet"), "rollouts")
    by_name = read_frame(str(tmp_path / "by-name.parquet"), "rollouts")
    assert len(mirrored) == len(PROMPTS) * 4  # tiny preset: K = 4
    assert mirrored["response"].tolist() == by_name["response"].tolist()
    assert set(mirrored["policy"]) == {out}  # the lineage names the export, not the pod's path


def test_every_folder_reader_reads_a_mirror_from_its_version(s3_env, pod):
    """The store's readers on a pod's mirror: the marker's files, from the version it names (an older
    version the writer had not yet deleted lies beside it), flat wherever a folder is handed out."""
    out = _export(s3_env, "readers")
    stale = f"{out}/{store.VERSIONS_DIR}/0-stale/config.json"  # a lost writer's, never named by the marker
    store.write_bytes(stale, b"{}")
    mirror = pod / out.removeprefix("s3://")
    download_artifact(out, mirror)
    manifest = store.read_manifest(str(mirror))
    assert manifest["layout"] == "versioned" and manifest == store.read_manifest(out)
    version = mirror / store.VERSIONS_DIR / manifest["token"]
    assert store.folder_file(str(mirror), "config.json") == str(version / "config.json")
    for folder in (resolve_model(str(mirror)), store.download_dir(str(mirror), pod / "unused")):
        assert folder.parent == mirror.parent  # a pinned version beside it: hard links, no copy
        assert store.folder_files(folder).keys() == manifest["files"].keys()
        assert (folder / "config.json").stat().st_ino == (version / "config.json").stat().st_ino
        assert store.read_manifest(str(folder))["layout"] == "flat"

    # A reference folder (a rollback's: it names the checkpoint to load) mirrored the same way.
    ref = f"s3://{s3_env}/readers/rollback-policy"
    write_reference(ref, out)
    ref_mirror = pod / ref.removeprefix("s3://")
    download_artifact(ref, ref_mirror)
    assert follow_reference(str(ref_mirror)) == out

    # A file the marker lists that the mirror lacks (a download cut short) is named, never skipped.
    (version / "config.json").unlink()
    for pinned in mirror.parent.glob(f".{mirror.name}.v-*"):  # the pins above hold their own links
        shutil.rmtree(pinned)
    with pytest.raises(ModelError, match="config.json is missing, though _COMPLETE lists it"):
        resolve_model(str(mirror))


def test_a_format_1_marker_in_a_mirror_is_read_from_its_version(s3_env, pod):
    """A marker without a layout (format 1, written before layouts were named) mirrored from S3: its
    files are where its version is, as on S3; a local folder with no such version stays flat."""
    out = _export(s3_env, "format-1")
    mirror = pod / out.removeprefix("s3://")
    download_artifact(out, mirror)
    doc = json.loads((mirror / store.COMPLETE_MARKER).read_bytes())
    del doc["layout"], doc["format"]
    (mirror / store.COMPLETE_MARKER).write_text(json.dumps(doc))
    assert store.read_manifest(str(mirror))["layout"] == "versioned"
    assert (resolve_model(str(mirror)) / "config.json").is_file()
