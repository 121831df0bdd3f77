"""Infrastructure that every layer above stands on, and that knows nothing of the method.

What belongs here: the typed configuration (`config`, `config_sections`, `config_loading`), the Arrow
schema of every artifact (`artifact_kinds`) and its files (`artifacts`), MLflow lineage (`tracking`,
`tracking_runs`, `tracking_records`), built-in and user models (`models`, `model_references`,
`model_folder_checks`), starting model servers (`serving`), running untrusted code (`sandbox`,
`sandbox_launch`, `_sandbox/`), log lines (`logs`) and stop signals (`stopping`). Storage is its own
package beside it (`store/`).
Nothing here imports from scoring, evaluation, training, stages or the local run.
"""
