"""The training loop's parts: prompt stream, rollout workers, metrics tracking, evaluation.

The loop itself is `asyncrl/controller.py`; it runs inside one Serve deployment.
"""
