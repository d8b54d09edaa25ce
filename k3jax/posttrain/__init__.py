"""Post-training (docs/posttraining.md): SFT on chat data, GRPO with partial rollout and
per-problem token budgets, and multi-teacher on-policy distillation (OPD).

Modules: :mod:`~k3jax.posttrain.tasks` (built-in verifiable tasks and their chat set),
:mod:`~k3jax.posttrain.sft` (chat JSONL -> packed rows with loss on assistant tokens),
:mod:`~k3jax.posttrain.objective` (per-token log-probs, the clipped policy-gradient loss),
:mod:`~k3jax.posttrain.rollout` (rollouts on the serving engine, paused and resumed across
iterations), :mod:`~k3jax.posttrain.loop` (the RL and OPD loops behind ``train.mode``).
"""
