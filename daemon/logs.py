"""Logging configuration for ``corral serve`` only (libraries just use ``logging.getLogger(__name__)``)."""

from __future__ import annotations

import logging
import sys

TRACE = 5


def configure(debug: int) -> None:
    logging.addLevelName(TRACE, "TRACE")
    level = logging.INFO if debug <= 0 else (logging.DEBUG if debug == 1 else TRACE)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("time=%(asctime)s level=%(levelname)s source=%(name)s msg=%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("uvicorn.access",):
        logging.getLogger(noisy).setLevel(logging.WARNING if debug <= 0 else logging.DEBUG)
