"""What several stage declarations share: the common params and models, and their checks."""

from __future__ import annotations

from pathlib import Path

from dynamicrubric.infra.artifacts import read_frames, write_artifact
from dynamicrubric.infra.config import MAX_SEED
from dynamicrubric.stages.spec import Data, ModelParam, Param

LABEL = Param("label", str, "which use of the stage in the round (generator, audit-after, ...)", "stage")
SHARD = Param("shard", int, "this shard's index", 0)
NUM_SHARDS = Param("num_shards", int, "number of prompt shards", 1)
SEED = Param("seed", int, "sampling seed (default: the config's seed)", None, bounds=(0, MAX_SEED))
POLICY = ModelParam("policy", "the policy (reference or checkpoint)", default_from="policy")
GENERATOR = ModelParam("generator", "the generator G (reference or checkpoint)", default_from="generator")
VERIFIER = ModelParam("verifier", "the frozen verifier V", default_from="verifier")
PREVIOUS_POLICY = ModelParam("previous_policy", "P_{t-1}, for the win rate (omit: none)")


def check_shard(values: dict) -> None:
    shard, num_shards = values["shard"], values["num_shards"]
    if num_shards < 1:
        raise ValueError(f"num_shards (--num-shards) must be >= 1, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard (--shard) must be within 0..{num_shards - 1}, got {shard}")


def merged(paths: list[str], kind: str, workdir: str) -> str:
    """One artifact holding all shards (a single path is used as it is)."""
    if len(paths) == 1:
        return paths[0]
    out = str(Path(workdir) / f"{kind}.parquet")
    write_artifact(out, kind, read_frames(paths, kind))
    return out


EVAL_PROMPTS = Data("eval_prompts", "prompts", "held-out prompts artifact")
