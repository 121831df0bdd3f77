"""Running the pipeline: locally under kfp.local, compiled, or submitted to Kubeflow Pipelines.

What belongs here: running, compiling and submitting (`launch`), the pre-imported server that local
tasks fork from (`task_processes`), watching local tasks and their one-line summaries
(`task_monitor`), the end-of-run round table (`round_table`) and the run report page (`run_page`,
`run_page_data`, `run_page_sections`).
"""
