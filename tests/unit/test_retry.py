"""The one retry policy: consecutive failures counted, progress starts the count again,
pauses double up to a cap."""

from __future__ import annotations

from service.retry import Backoff


def test_gives_up_after_the_allowed_retries_with_doubling_pauses() -> None:
    backoff = Backoff(retries=3, base_seconds=0.001)
    delays = []
    while backoff.failed():
        delays.append(backoff.delay())
    assert backoff.failures == 4
    assert delays == [0.001, 0.002, 0.004]


def test_an_attempt_that_progressed_starts_the_count_again() -> None:
    backoff = Backoff(retries=1, base_seconds=0.001)
    assert backoff.failed()
    assert backoff.failed(progressed=True) and backoff.failures == 0
    assert backoff.failed() and not backoff.failed()


def test_pauses_are_capped() -> None:
    backoff = Backoff(retries=10, base_seconds=0.5, cap_seconds=5.0, failures=8)
    assert backoff.delay() == 5.0
    backoff.succeeded()
    assert backoff.failures == 0 and backoff.delay() == 0.5
