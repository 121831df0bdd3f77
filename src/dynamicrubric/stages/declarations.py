"""Every pipeline stage, declared once: its parameters, models, input and output artifacts, and the
function that does its work (frames in, frames out live in the method modules; these read and write
the artifacts). They are declared by what they do — data_stages.py, scoring_stages.py,
training_stages.py, evaluation_stages.py — and listed here.

From a declaration come the KFP component (kfp_source.py), the `dynrubric stage`
flags (cli.py), the MLflow run's params and datasets (runner.py) and `--from-run` (rerun.py).
Values reach `run` by name: params and models as given, artifacts as URIs ("" or [] when an optional
one is absent, a list for sharded ones), outputs as `out_<name>`.
"""

from __future__ import annotations

from dynamicrubric.stages.data_stages import CANDIDATES, PREPARE_DATA, ROLLOUT
from dynamicrubric.stages.evaluation_stages import CHECK_SAMPLES, EVALUATE, EVALUATE_SAMPLES, ROLLBACK
from dynamicrubric.stages.scoring_stages import AGGREGATE, JUDGE, RUBRICS
from dynamicrubric.stages.spec import Stage
from dynamicrubric.stages.training_stages import TRAIN_EVALUATOR, TRAIN_POLICY

STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        PREPARE_DATA,
        ROLLOUT,
        CANDIDATES,
        RUBRICS,
        JUDGE,
        AGGREGATE,
        TRAIN_EVALUATOR,
        TRAIN_POLICY,
        EVALUATE_SAMPLES,
        CHECK_SAMPLES,
        EVALUATE,
        ROLLBACK,
    )
}
