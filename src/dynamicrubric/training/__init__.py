"""Both online GRPO trainers (TRL's `GRPOTrainer`), thin around TRL, and how they are launched.

What belongs here: the reward functions (`policy_reward`, `generator_rewards`, `reward_common`,
`reward_parts`: the scoring layer's code as TRL rewards), the trainer set-up and arguments (`grpo`,
`arguments`, `monitoring`, `data`), checkpoints (`checkpoints`), the launch on one node (`launcher`,
`process`, `fsdp_hook`, `cpu_waits`) and on several through a Kubeflow Trainer TrainJob (`trainjob`,
`on_nodes`, `node`).
"""
