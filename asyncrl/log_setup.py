"""`asyncrl` loggers at INFO on stderr, once per process: the trainer's (trainer/logging_setup.py adds
its progress line) and each engine replica's (Serve keeps a replica's stderr in its worker log).

Owns: the log line format. Must never: import another asyncrl package (every package may call it).
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def asyncrl_logs_at_info() -> None:
    logger = logging.getLogger("asyncrl")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    logger.setLevel(logging.INFO)
