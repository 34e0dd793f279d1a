"""What ac-core logged during a check. (Which module ran which op and what ``ops`` retained are ac-core's own
public instruments: :func:`ac_core.measure.attribute_ops` and :func:`ac_core.observe_retention`.)"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def capture_logs(logger_name: str = "ac_core", level: int = logging.WARNING) -> Iterator[list[logging.LogRecord]]:
    """Collect the records ``logger_name`` emits at ``level`` or above, whatever logging is configured."""
    logger = logging.getLogger(logger_name)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level)
    handler.emit = records.append  # type: ignore[method-assign]
    previous = logger.level
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


__all__ = ["capture_logs"]
