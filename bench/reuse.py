"""Result reuse: wall time of a job that computes vs an identical one that reuses its result.

A real service (SQLite, local pool) on loopback, a real checkpoint from the test-model corpus
(``tests/fixtures/real_models.py``), the same request submitted twice. Prints, per model: the
first job's wall (its ``metrics.wall_seconds``, and submit-to-succeeded as a client sees it),
the reusing job's, and the bytes it shares by hard links.

    .venv/bin/python -m bench.reuse smollm2 qwen2
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.fixtures.real_models import real_model
from tests.fixtures.service import ServiceProcess, running_service

EXPORTS = [{"format": "safetensors"}, {"format": "gguf", "type": "f16"}]


def timed_job(svc: ServiceProcess, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    with svc.client() as client:
        response = client.post("/v1/jobs", json=body)
    response.raise_for_status()
    job = svc.wait_for(response.json()["id"], timeout=1800)
    elapsed = time.monotonic() - started
    if job["status"] != "succeeded":
        raise SystemExit(f"job failed: {job['error']}")
    return job, elapsed


def main() -> None:
    names = sys.argv[1:] or ["smollm2"]
    rows = []
    for name in names:
        model = real_model(name)
        with tempfile.TemporaryDirectory() as tmp, \
                running_service(Path(tmp) / "data", [model.parent]) as svc:
            body = {"source": f"file://{model}", "exports": EXPORTS}
            first, first_client = timed_job(svc, body)
            again, again_client = timed_job(svc, body)
            assert again["reused_from"] == first["id"], again.get("reuse")
            rows.append((name, first["metrics"]["wall_seconds"], first_client,
                         again["metrics"]["wall_seconds"], again_client,
                         again["metrics"]["reused_bytes"]))
    print("| model | first job wall s | first submit→done s | reused job wall s "
          "| reused submit→done s | shared bytes |")
    print("|---|---|---|---|---|---|")
    for name, fw, fc, rw, rc, shared in rows:
        print(f"| {name} | {fw:.2f} | {fc:.2f} | {rw:.3f} | {rc:.2f} | {shared} |")


if __name__ == "__main__":
    main()
