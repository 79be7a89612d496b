"""The serving core's logger, and where its lines go: an engine adapter sends them through its
engine's own logger (`log_to`), so that they appear where that engine prints its lines."""

from __future__ import annotations

import logging

__all__ = ["log", "log_to"]

log = logging.getLogger("shmstore.serving")


class _Forward(logging.Handler):
    """Hands every record to another logger (and so to its handlers)."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(self.target).handle(record)


def log_to(name: str) -> None:
    """Send the serving core's lines through logger `name` from now on (idempotent)."""
    if any(isinstance(h, _Forward) and h.target == name for h in log.handlers):
        return
    for handler in [h for h in log.handlers if isinstance(h, _Forward)]:
        log.removeHandler(handler)
    log.addHandler(_Forward(name))
    log.propagate = False
