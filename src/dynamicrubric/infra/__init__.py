"""Infrastructure that every layer above stands on, and that knows nothing of the method.

What belongs here: the typed configuration (`config`, `config_sections`), the Arrow schema of every
artifact (`artifacts`), MLflow lineage (`tracking`), built-in and user models (`models`), starting
model servers (`serving`), running untrusted code (`sandbox`, `sandbox_launch`, `_sandbox/`), log
lines (`logs`) and stop signals (`stopping`). Storage is its own package beside it (`store/`).
Nothing here imports from scoring, evaluation, training, stages or the local run.
"""
