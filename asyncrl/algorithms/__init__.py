"""RL algorithm math: advantage estimators and losses as pure torch functions.

Owns: the public API for adding an algorithm: every function here maps tensors to tensors (and
python-float metrics) with the formula in its docstring.

Must never: import Megatron, Ray, an engine or any other asyncrl component, start a process, or
keep state between calls. The learner decides what to call; this package only computes.
"""

from asyncrl.algorithms.advantages import (
    gae_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    token_rewards_from_sequence,
    weight_negative_advantages,
)
from asyncrl.algorithms.correction import Correction, correction_weights
from asyncrl.algorithms.losses import (
    AggMode,
    KLKind,
    aggregate,
    gspo_policy_loss,
    kl_divergence,
    kl_loss_term,
    kl_penalty_rewards,
    ppo_policy_loss,
    value_loss,
)
from asyncrl.algorithms.mismatch import combine_mismatch_sums, mismatch_metrics, mismatch_sums
from asyncrl.algorithms.utils import masked_mean, masked_sum, masked_whiten

__all__ = [
    "AggMode",
    "Correction",
    "KLKind",
    "aggregate",
    "combine_mismatch_sums",
    "correction_weights",
    "gae_advantages",
    "grpo_advantages",
    "gspo_policy_loss",
    "kl_divergence",
    "kl_loss_term",
    "kl_penalty_rewards",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "mismatch_metrics",
    "mismatch_sums",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "token_rewards_from_sequence",
    "value_loss",
    "weight_negative_advantages",
]
