"""The checks every config section runs in `__post_init__`: a key whose value is wrong raises `ConfigError`
naming the key, the value (summarized), why, and what to set instead."""

from __future__ import annotations

import math

from tandemrl.config.errors import ConfigError, value_summary


def _check(ok: bool, key: str, value: object, why: str, fix: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value_summary(value)}: {why}. {fix}")


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, key, value, f"must be one of {', '.join(choices)}", f"Set {key} to one of them.")


def _check_positive(key: str, value: int | float | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    _check(value is not None and value > 0, key, value, "must be > 0", f"Set {key} to a positive number.")


# counts and ids beyond int32 are no real request, and overflow the engines' int32 and int64 tensors
MAX_INT32 = 2**31 - 1

MAX_SECONDS = 365 * 24 * 3600  # a year: far above any wait, far below what `Event.wait` takes (it overflows)


def _check_finite_positive(key: str, value: float | None, allow_none: bool = False) -> None:
    """A number of seconds: finite, > 0, at most MAX_SECONDS (1e18 reached `time.sleep` as an OverflowError)."""
    if value is None and allow_none:
        return
    _check(
        value is not None and math.isfinite(value) and 0 < value <= MAX_SECONDS,
        key,
        value,
        f"must be a number of seconds > 0 and at most {MAX_SECONDS:,} (a year)",
        f"Set {key} to a positive number of seconds.",
    )


def _is_host_port(addr: object) -> bool:
    """`host:port` or `http(s)://host:port` (an IPv6 host in brackets), a port of ASCII digits in 1..65535
    (`int` would also read '٣٠' or '3_0')."""
    if not isinstance(addr, str):
        return False
    rest = addr.removeprefix("http://").removeprefix("https://").rstrip("/")
    host, _, port = rest.rpartition(":")
    return (
        bool(host.strip())
        and "/" not in rest
        and port.isascii()
        and port.isdigit()
        and 1 <= int(port) <= 65535
    )
