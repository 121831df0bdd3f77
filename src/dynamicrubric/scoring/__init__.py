"""One round's method, from a prompt to a score: what the rollout, rubrics, judge and aggregate
stages compute, and what both trainers' reward functions call.

What belongs here: sampling the policy's K responses (`rollout`), every prompt template and the rubric
parser (`prompts`), the generator's rubrics (`rubrics`), the verifier's verdicts (`judge`), and the
scores, signal diagnostics and generator rewards (`aggregate`, with its integer codes in
`aggregate_codes`). A new way to write, judge or aggregate rubrics goes here; what reports on a round
goes in `evaluation`.
"""
