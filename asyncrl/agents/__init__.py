"""Agent functions for `rollout.kind: agent` (async def f(prompt, client) -> reward)."""
