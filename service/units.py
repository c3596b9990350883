"""Human byte sizes as users write them ("5GB", "512MiB", 1000000)."""

from __future__ import annotations

import re

from service.errors import InvalidRequest

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Bytes in ``value``; decimal units (GB) are powers of 10, binary ones (GiB) of 2, as in
    transformers' ``max_shard_size``."""
    if isinstance(value, bool):
        raise InvalidRequest(f"invalid size {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise InvalidRequest(f"size must be positive, got {value}")
        return value
    match = _SIZE.match(value)
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidRequest(f"invalid size {value!r}; use e.g. 5GB, 500MB or 1GiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise InvalidRequest(f"size must be positive, got {value!r}")
    return size


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: str | float) -> float:
    """Seconds in ``value``: a number of seconds, or ``90s``, ``15m``, ``12h``, ``30d``, ``2w``."""
    if isinstance(value, bool):
        raise InvalidRequest(f"invalid duration {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(value.lower())
        if match is None:
            raise InvalidRequest(f"invalid duration {value!r} (e.g. 3600, 90m, 12h, 30d)")
        seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if seconds <= 0:
        raise InvalidRequest(f"duration {value!r} must be positive")
    return seconds
