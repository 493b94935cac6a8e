"""Learner roles: one plain class per role, each running inside one initialised rank.

Owns: the role name -> class map the rank actor builds from. A role composes a `ModelRunner`
(model + passes), and, when it trains, a `GuardedOptimizer` and an `Offloader`; no role class
carries flags for another role's behaviour.

Must never: import Ray (the rank actor around a role is the only transport).
"""

from __future__ import annotations

from asyncrl.learner.roles.actor import ActorRole
from asyncrl.learner.roles.base import ModelRunner, RoleContext
from asyncrl.learner.roles.critic import CriticRole
from asyncrl.learner.roles.reference import ReferenceRole
from asyncrl.learner.roles.reward_model import RewardModelRole

ROLE_CLASSES: dict[str, type] = {
    "actor": ActorRole,
    "reference": ReferenceRole,
    "critic": CriticRole,
    "reward_model": RewardModelRole,
}

__all__ = ["ROLE_CLASSES", "ActorRole", "CriticRole", "ModelRunner", "ReferenceRole", "RewardModelRole", "RoleContext"]
