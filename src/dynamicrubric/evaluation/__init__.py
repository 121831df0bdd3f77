"""What a round reports about its evaluator and its policy.

What belongs here: the evaluate stage's work (`evaluate`), accuracy and win-rate metrics
(`metrics`), labelled pairs and ranked lists (`labelled`), the signal audit's probe (`probe`), the
signal guard (`guard`), per-item usefulness (`item_usefulness`), judged sets traced to MLflow
(`traced_sets`), plots (`plots`) and interval statistics (`stats`). A new benchmark or guard check
goes here.
"""
