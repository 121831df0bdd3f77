"""What a stage task records in its MLflow run: its artifacts as datasets, its params, metrics and
models (`StageRun`), and the judged candidate sets as traces (`log_traced_sets`).

Kept apart from `tracking_runs`, which opens the run these go into: logging into an open run needs
nothing of how runs are created, nested and spanned.
"""

from __future__ import annotations

import hashlib
import logging
import os
import warnings

from dynamicrubric.infra.tracking import NAME_TAG, PIPELINE_TAG, POSITION_TAG, mlflow_source

# The lineage's one logger (these lines were `dynamicrubric.infra.tracking`'s before the split), so that
# what filters or captures it still sees every one.
log = logging.getLogger("dynamicrubric.infra.tracking")


MAX_TAG_CHARS = 5000  # MLflow's limit on a tag's value


class StageRun:
    """Logging helpers bound to one stage's MLflow run."""

    def __init__(self, mlflow, run_id: str):
        self.mlflow = mlflow
        self.run_id = run_id
        self.summary: dict[str, float] = {}  # the numbers of log_metrics, for the task's one log line

    def log_artifact_dataset(
        self, uri: str, kind: str, context: str, *, name: str = "", position: int = 0
    ) -> None:
        """Record an artifact as an MLflow dataset input ('input' or 'output') whose source is its URI,
        tagged with the stage's name for it and, for a list of shards, its position in the list."""
        from dynamicrubric.infra.artifacts import read_frame
        from dynamicrubric.store import read_bytes

        frame = read_frame(uri, kind)
        source = mlflow_source(uri)
        # MLflow keeps one dataset per (name, digest) in an experiment and shows the first source it
        # saw: the URI is part of the digest, so a byte-identical copy at another URI (a task that
        # passes its input through) is a dataset of its own with its own source.
        digest = hashlib.sha256(source.encode() + b"\0" + read_bytes(uri)).hexdigest()[:16]
        tags = {"kind": kind, "uri": source, NAME_TAG: name or kind, POSITION_TAG: str(position)}
        # Schema inference warns about int columns when the dataset is built and again when it is
        # logged (its profile and schema are computed lazily): both stay inside the filter.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Ii]nferred schema.*")
            warnings.simplefilter("ignore", UserWarning)
            dataset = self.mlflow.data.from_pandas(frame, source=source, name=kind, digest=digest)
            try:
                self.mlflow.log_input(dataset, context=context, tags=tags)
            except self.mlflow.exceptions.MlflowException as e:
                # Two shards logging the same input at once race on MLflow's check-then-insert of the
                # dataset row (UNIQUE constraint on a SQL store); the row exists now, so once more finds it.
                # sqlite: "UNIQUE constraint failed"; postgres: "duplicate key value"
                message = str(e).lower()
                if "unique constraint" not in message and "duplicate" not in message:
                    raise
                log.info("MLflow: dataset %s was logged concurrently; retrying", uri)
                self.mlflow.log_input(dataset, context=context, tags=tags)

    def set_tags(self, tags: dict[str, str], *, above: dict[str, str] | None = None) -> None:
        """`tags` on this run, and `above` (default: the same) on every run it is nested under (its
        round's run and the pipeline's parent run), where the MLflow run list shows them."""
        client = self.mlflow.MlflowClient()
        run_id, values = self.run_id, tags
        while run_id:
            for key, value in values.items():
                client.set_tag(run_id, key, value[:MAX_TAG_CHARS])
            run_id = client.get_run(run_id).data.tags.get("mlflow.parentRunId", "")
            values = tags if above is None else above

    def log_params(self, params: dict[str, object]) -> None:
        """The stage's inputs that are not artifacts (model references, seeds, shard), to rerun it."""
        self.mlflow.log_params({k: str(v) for k, v in params.items()})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        numeric = {
            k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if numeric:
            self.mlflow.log_metrics(numeric, step=step)
            if step is None:
                self.summary.update(numeric)

    def log_metrics_table(self, uri: str) -> None:
        """Log a `metrics` artifact: per-step rows with their step, the rest at step 0."""
        from dynamicrubric.infra.artifacts import read_frame

        self.log_metric_rows(read_frame(uri, "metrics").to_dict("records"))

    def log_metric_rows(self, rows: list[dict]) -> None:
        """Rows shaped as a `metrics` artifact's (name, value, step, variant), each at its step."""
        for row in rows:
            key = f"{row['variant']}/{row['name']}" if row["variant"] else row["name"]
            self.mlflow.log_metric(key, row["value"], step=int(row["step"]))

    def log_model(self, run_name: str, name: str, uri: str, params: dict[str, str] | None = None) -> str:
        """An external LoggedModel pointing at a checkpoint's URI, listed in this run's model outputs;
        returns its model id."""
        from mlflow.entities import LoggedModelOutput

        model = self.mlflow.create_external_model(
            name=name,
            source_run_id=self.run_id,
            params={k: str(v) for k, v in (params or {}).items()},
            tags={"uri": mlflow_source(uri), PIPELINE_TAG: run_name},
        )
        self.mlflow.MlflowClient().log_outputs(
            self.run_id, models=[LoggedModelOutput(model.model_id, step=0)]
        )
        return model.model_id

    def find_model(self, run_name: str, name: str) -> str | None:
        """The id of the LoggedModel `name` logged by this pipeline run, if any."""
        experiment_id = self.mlflow.get_run(self.run_id).info.experiment_id
        models = self.mlflow.search_logged_models(
            experiment_ids=[experiment_id],
            filter_string=f"name = '{name}' AND tags.`{PIPELINE_TAG}` = '{run_name}'",
            output_format="list",
        )
        return models[0].model_id if models else None

    def log_model_metrics(self, model_id: str, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.mlflow.log_metric(key, float(value), model_id=model_id)

    def log_dir(self, local_dir: str, artifact_path: str) -> None:
        self.mlflow.log_artifacts(local_dir, artifact_path)


GOLD_NAME = "gold"  # the Expectation of a judged response: its rank in its labelled list, its checker score


def log_traced_sets(run: StageRun, sets: list[dict], round_idx: int) -> list[str]:
    """Each judged candidate set (evaluate.traced_sets) as one MLflow trace of the stage's run: a
    span for G's rubrics (items, weights, whether its output parsed, the model), a span per response
    with its score, V's P(yes) on each item as a Feedback named by the item (weight as rationale,
    source LLM_JUDGE with the verifier's reference; a failed verdict as an error, never a 0), and
    the response's gold as an Expectation. Returns the trace ids.

    The assessments go into the trace before it is exported, so a trace is one write to the store
    (log_feedback after the trace is one write per assessment: about 30 ms each on sqlite)."""
    from mlflow.entities import AssessmentError, AssessmentSource, AssessmentSourceType, SpanType
    from mlflow.entities.assessment import Expectation, Feedback
    from mlflow.tracing.trace_manager import InMemoryTraceManager

    # the trace is written when its root span ends, not by a background thread that may lag the run
    os.environ["MLFLOW_ENABLE_ASYNC_TRACE_LOGGING"] = "false"
    mlflow = run.mlflow
    ids = []
    for s in sets:
        judge = AssessmentSource(source_type=AssessmentSourceType.LLM_JUDGE, source_id=s["verifier"])
        items = {(r["rubric_idx"], i): item for r in s["rubrics"] for i, item in enumerate(r["items"])}
        with mlflow.start_span(name=f"judged set {s['set_id']}", span_type=SpanType.EVALUATOR) as root:
            trace_id = root.trace_id
            root.set_inputs({"prompt": s["prompt"], "responses": len(s["responses"])})
            root.set_attributes({"round": round_idx, "job": s["job"], "variant": s["variant"]})
            with mlflow.start_span(name="rubric generation", span_type=SpanType.LLM) as gen:
                gen.set_inputs({"prompt": s["prompt"], "model": s["generator"]})
                gen.set_outputs({"rubrics": s["rubrics"]})
                held = all(r["parse_status"] == "json" for r in s["rubrics"])
                gen.set_attributes({"model": s["generator"], "grammar_held": held})
            assessments = []
            for response in s["responses"]:
                sample = response["sample_idx"]
                with mlflow.start_span(name=f"judge response {sample}", span_type=SpanType.LLM) as span:
                    span.set_inputs({"response": response["response"], "model": s["verifier"]})
                    span.set_outputs({"scores": response["scores"], "gold": response["gold"]})
                    span.set_attributes({"model": s["verifier"], "sample_idx": sample})
                meta = {"sample_idx": str(sample)}
                for v in response["verdicts"]:
                    item = items.get((v["rubric_idx"], v["item_idx"]))
                    if item is None:
                        continue
                    failed = v["p_yes"] is None
                    assessments.append(
                        Feedback(
                            name=f"r{v['rubric_idx']}.{v['item_idx']}: {item['text']}"[:250],
                            value=None if failed else v["p_yes"],
                            error=AssessmentError(
                                error_code="VERDICT_FAILED", error_message="the verifier's call failed"
                            )
                            if failed
                            else None,
                            rationale=f"weight {item['weight']}",
                            source=judge,
                            trace_id=trace_id,
                            span_id=span.span_id,
                            metadata=meta,
                        )
                    )
                if response["gold"]:
                    assessments.append(
                        Expectation(
                            name=GOLD_NAME,
                            value=response["gold"],
                            trace_id=trace_id,
                            span_id=span.span_id,
                            metadata=meta,
                        )
                    )
            root.set_outputs({str(r["sample_idx"]): r["scores"] for r in s["responses"]})
            with InMemoryTraceManager.get_instance().get_trace(trace_id) as live:
                live.info.assessments.extend(assessments)
        ids.append(trace_id)
    return ids


def log_benchmark_pairs(run: StageRun, pairs: list[dict], round_idx: int) -> list[str]:
    """Each judged benchmark prompt (benchmark_judge.BenchmarkResults.traced) as one MLflow trace of the
    stage's run: the prompt and the answers as the root span's inputs, a span per question with the
    judge's P(yes) as a Feedback (source LLM_JUDGE, the judge's label; a failed call as an error, never a
    verdict). Returns the trace ids."""
    from mlflow.entities import AssessmentError, AssessmentSource, AssessmentSourceType, SpanType
    from mlflow.entities.assessment import Feedback
    from mlflow.tracing.trace_manager import InMemoryTraceManager

    os.environ["MLFLOW_ENABLE_ASYNC_TRACE_LOGGING"] = "false"  # written when its root span ends
    mlflow = run.mlflow
    ids = []
    for pair in pairs:
        judge = AssessmentSource(source_type=AssessmentSourceType.LLM_JUDGE, source_id=pair["judge"])
        name = f"benchmark {pair['benchmark']} {pair['id']}"
        with mlflow.start_span(name=name, span_type=SpanType.EVALUATOR) as root:
            trace_id = root.trace_id
            root.set_inputs({"benchmark": pair["benchmark"], "id": pair["id"], "answers": pair["answers"]})
            root.set_attributes({"round": round_idx, "judge": pair["judge"]})
            assessments = []
            for q in pair["questions"]:
                label = f"{q['measure']} {q['criterion'] or ('judged answer first', 'judged answer second')[q['order']]}"
                with mlflow.start_span(name=label[:250], span_type=SpanType.LLM) as span:
                    span.set_inputs({"question": q["question"]})
                    span.set_outputs({"p_yes": q["p_yes"]})
                failed = q["p_yes"] is None
                assessments.append(
                    Feedback(
                        name=label[:250],
                        value=None if failed else q["p_yes"],
                        error=AssessmentError(
                            error_code="VERDICT_FAILED", error_message="the judge's call failed"
                        )
                        if failed
                        else None,
                        source=judge,
                        trace_id=trace_id,
                        span_id=span.span_id,
                    )
                )
            with InMemoryTraceManager.get_instance().get_trace(trace_id) as live:
                live.info.assessments.extend(assessments)
        ids.append(trace_id)
    return ids
