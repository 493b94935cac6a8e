"""asyncrl: asynchronous RL post-training for LLMs.

Rollout is a Ray Serve deployment of vLLM engines (also a live HTTP API), the learner is a
Megatron-core group, weights flow through the versioned, verified weightsync service, and a
buffer bounds staleness by the rule in docs/ARCHITECTURE.md.
"""

__version__ = "0.1.0"
