"""Every pipeline stage, declared once and run by one runner.

What belongs here: the declarations (`declarations`, `spec`), each stage's work function by kind
(`data_stages`, `scoring_stages`, `training_stages`, `evaluation_stages`, `common`), the runner that
a KFP task, `dynrubric stage` and `--from-run` all go through (`runner`, `rerun`), and the generator of
`components/stages.py` (`kfp_source`).
"""
