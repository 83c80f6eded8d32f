"""The command line's log format, vLLM's: `INFO 12-05 08:30:00 [engine.py:123] message`.

Every module logs to the "qwen4exp" logger; `configure_logging` (called once by the CLI) gives it one handler on
stderr at INFO. The library itself configures nothing, so programs that import qwen4exp keep their own logging.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (it may be replaced after set-up, as test runners and
    embedding programs do)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def configure_logging(level: int = logging.INFO) -> None:
    """Idempotent: the qwen4exp logger gets the handler once."""
    log = logging.getLogger("qwen4exp")
    log.setLevel(level)
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        log.addHandler(handler)
