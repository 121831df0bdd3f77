"""dynamicrubric: evaluator-policy co-evolution (DynamicRubric) as Kubeflow pipelines.

The package is in layers, lowest first; a module imports only from its own layer or the ones below
(tests/test_layering.py holds the order and fails on an import that points up or closes a circle):

- `infra`, `store`: configuration, artifact schemas, S3 and local storage, MLflow lineage, built-in
  models, model servers, the sandbox for untrusted code, logging and stop signals;
- `engines`: one inference interface over transformers, vLLM and an OpenAI-compatible server, and
  constrained decoding under the rubric's grammar;
- `tasks`: prompt sources, verifiable checkers, anchor lists;
- `scoring`: one round's method: rollout, rubric prompts and generation, judging, aggregation;
- `evaluation`: what a round reports: the evaluate stage, metrics, the signal guard, plots;
- `training`: both online GRPO trainers (TRL) and how they are launched, on one node or several;
- `stages`: every pipeline stage declared once and run by one runner (KFP task, CLI, rerun);
  `dynamicrubric.components` and `dynamicrubric.pipelines` (folders `components/`, `pipelines/`) sit
  beside it;
- `localrun`: running, compiling and submitting the pipeline, watching local tasks, the run's report;
- `cli`: the `dynrubric` command.
"""
