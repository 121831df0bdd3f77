"""One KFP component per pipeline stage: the two set-up tasks here, and every declared stage's
component made from its declaration (dynamicrubric.stages.kfp_source; see a stage's source with
`python -m dynamicrubric.stages.kfp_source NAME`). Each stage's body only hands its values, by name,
to `dynamicrubric.stages.runner.run_task`.

Lightweight components (`install_kfp_package=False`, nothing to pip-install): the one authoring
style that runs both under `kfp.local.SubprocessRunner` and on a cluster, where the image already
holds the project. `build(image, cpu_image)` binds every stage function to its image.

A model input is a reference string (a built-in name, hub id or folder) plus an optional checkpoint
artifact from an earlier round; when the checkpoint is given it wins.
"""

from types import SimpleNamespace
from typing import Dict  # KFP parses typing.Dict, not dict[...]

from kfp import dsl
from kfp.dsl import Artifact, Output

from dynamicrubric.infra.config import STAGE_FACTS
from dynamicrubric.stages.kfp_source import ON_NODES, component_functions


def start_tracking(config_yaml: str, run_name: str, first_round: int, config: Output[Artifact]):
    """Open (or, after the first segment of a chained run, join) the MLflow parent run, and write the
    config as the artifact every other task reads: the YAML travels inline to this task only."""
    from dynamicrubric.stages.runner import start_tracking as run

    run(config_yaml, run_name, first_round, config.path)


def stage_models(plan: Dict[str, str]) -> Dict[str, str]:
    """Copy each base model to where the plan says tasks read it (models.staging_plan)."""
    import logging

    from dynamicrubric.infra.models import stage_models as run

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(plan)


STAGES = [start_tracking, stage_models, *component_functions().values()]


def build(image: str, cpu_image: str) -> SimpleNamespace:
    """Every stage as a KFP component: stages that run a model in `image`, the others (STAGE_FACTS)
    in the smaller `cpu_image` (stage_models only copies weights)."""
    return SimpleNamespace(
        **{
            f.__name__: dsl.component(
                f,
                base_image=image if STAGE_FACTS[f.__name__.removesuffix(ON_NODES)].runs_model else cpu_image,
                install_kfp_package=False,
            )
            for f in STAGES
        }
    )
