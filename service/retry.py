"""The one retry policy of every transfer (HTTP sources, the hub, the client's downloads and
event stream): count consecutive failed attempts, give up past a limit, and between attempts
pause ``base × 2^(n-1)`` seconds (n: failures so far), capped.

Only *consecutive* failures count when the caller says an attempt made progress: a large
download over a flaky link that moves forward on every attempt is never given up on, while
one that makes no progress stops after ``retries`` more attempts. What is retried, and the
typed error raised on giving up, stay with the caller: they differ per protocol.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass
class Backoff:
    retries: int
    """Failed attempts in a row allowed after the first."""
    base_seconds: float
    cap_seconds: float = math.inf
    failures: int = 0
    """Consecutive failed attempts so far (for the caller's message on giving up)."""

    def delay(self) -> float:
        """The pause before the next attempt, after ``failures`` failures."""
        return min(self.base_seconds * 2.0 ** max(self.failures - 1, 0), self.cap_seconds)

    def failed(self, *, progressed: bool = False) -> bool:
        """Record a failed attempt (one that ``progressed`` starts the count again), then either
        pause and return True (try again), or return False: the retries are spent."""
        self.failures = 0 if progressed else self.failures + 1
        if self.failures > self.retries:
            return False
        time.sleep(self.delay())
        return True

    def succeeded(self) -> None:
        """An attempt got through: the next failure is the first again."""
        self.failures = 0
