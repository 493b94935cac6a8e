"""The training loop's parts: prompt stream, rollout workers, metrics tracking, evaluation.

The loop itself is `loop.py` (`Trainer`); it runs inside one Serve deployment (asyncrl/app.py).
"""
