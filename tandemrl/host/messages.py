"""Errors said in one line: what the plug-in loader, the trackers and the metrics logger put in front of the
user when code they did not write fails (agent/plugin.py, metrics/trackers.py, metrics/logger.py)."""

from __future__ import annotations


def one_line(error: BaseException) -> str:
    """`Type: message` with whitespace collapsed and at most 300 characters of message."""
    text = " ".join(str(error).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
