from __future__ import annotations

import pytest

from service.errors import InvalidRequest
from service.units import parse_size


@pytest.mark.parametrize(
    ("text", "size"),
    [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("1GiB", 2**30), ("1.5 KiB", 1536), (42, 42)],
)
def test_sizes_parse_like_transformers(text: str | int, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GB", "-1GB", "5 parsecs", "0", 0, True])
def test_bad_sizes_are_invalid_requests(text: str | int) -> None:
    with pytest.raises(InvalidRequest):
        parse_size(text)
