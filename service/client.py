"""A small synchronous client of the modelprep HTTP API, for the CLI and for platform code.

    with ModelprepClient("http://127.0.0.1:8000", api_key) as client:
        job = client.submit({"source": "hf://org/model", "exports": [{"format": "gguf"}]})
        for event in client.follow(job["id"]):      # live progress, reconnecting as needed
            print(event.kind, event.data["phase"], event.data["progress"])
        files = client.download(client.job(job["id"]), Path("out"))  # resumable, sha256-checked

Errors are typed (``service.errors``): :class:`ApiError` for a problem+json answer (its
``http_status`` and ``problem``), :class:`ServiceUnreachable` when there is no answer,
:class:`ArtifactCorrupt` when a download does not match the artifact list. Nothing here imports
torch or the service's pipeline, so the client stays light.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any, Self

import httpx
from httpx_sse import SSEError, connect_sse

from service.errors import (
    ApiError,
    ArtifactCorrupt,
    ArtifactsDeleted,
    ClientError,
    ServiceUnreachable,
)
from service.fsutil import sha256_file
from service.retry import Backoff

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
CHUNK = 1 << 20

DownloadProgress = Callable[[str, int, int], None]
"""``(artifact path, bytes done, bytes total)`` after each chunk written."""


@dataclass(frozen=True)
class JobEvent:
    """One event of a job's stream: ``kind`` is status, phase or progress; ``data`` the
    JobEvent JSON (id, version, status, phase, progress, metrics, error)."""

    kind: str
    version: int
    data: dict[str, Any]

    @property
    def terminal(self) -> bool:
        return self.data.get("status") in TERMINAL


URL_HINT = "change it with --url or MODELPREP_URL"
"""How a CLI user points the client elsewhere; every error about the service's address ends
with it."""


def service_root(url: str) -> str:
    """The service's root URL from what a user typed: ``host:port`` gets ``http://``, and a
    trailing ``/`` or ``/v1`` (the API's prefix, which the client adds itself) is dropped."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    scheme = text.split("://", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise ClientError(
            f"service URL {url!r}: use http://HOST:PORT or https://HOST ({URL_HINT})"
        )
    text = text.rstrip("/")
    text = text.removesuffix("/v1")
    return text


def _problem_of(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return body
    return {"status": response.status_code, "title": response.reason_phrase,
            "detail": response.text[:500]}


def problem_code(problem: Mapping[str, Any]) -> str | None:
    """The short code of a modelprep problem (the last part of its ``type`` URI), or None
    when the body is not one of modelprep's problems (another server answered)."""
    kind = problem.get("type")
    if not isinstance(kind, str) or "/problems/" not in kind:
        return None
    return kind.rsplit("/", 1)[-1]


def _raise_for_problem(response: httpx.Response) -> None:
    if response.is_success:
        return
    problem = _problem_of(response)
    detail = problem.get("detail") or problem.get("title") or response.reason_phrase
    code = problem_code(problem)
    where = f"{response.request.method} {response.request.url}"
    if code is None:
        message = (f"{where} answered {response.status_code} {response.reason_phrase}, "
                   f"which is not a modelprep answer: is that the service's address? ({URL_HINT})")
    elif code in ("not_found", "method_not_allowed"):
        message = (f"{where}: {response.status_code} {detail}: no such API route here, is "
                   f"that the service's root? ({URL_HINT})")
    else:
        message = f"{code}: {detail}"
    raise ApiError(message, response.status_code, problem)


class ModelprepClient:
    """Jobs over HTTP: submit, inspect, list, cancel, follow, download."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = service_root(base_url)
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _unreachable(self, what: str, exc: Exception) -> ServiceUnreachable:
        """A :class:`ServiceUnreachable` naming the address tried and how to change it."""
        reason = str(exc) or type(exc).__name__
        return ServiceUnreachable(
            f"no answer from modelprep at {self.base_url} ({what}: {reason}); {URL_HINT}"
        )

    def _request(self, method: str, url: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, url, **kwargs)
        except httpx.HTTPError as exc:
            raise self._unreachable(f"{method} {url}", exc) from exc
        _raise_for_problem(response)
        return response.json()

    # --- jobs --------------------------------------------------------------------------------

    def submit(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """Queue a job (the ``POST /v1/jobs`` body); the queued job's JSON."""
        job: dict[str, Any] = self._request("POST", "/v1/jobs", json=dict(spec))
        return job

    def job(self, job_id: str) -> dict[str, Any]:
        job: dict[str, Any] = self._request("GET", f"/v1/jobs/{job_id}")
        return job

    def jobs(self, status: str | None = None, page_size: int = 50) -> Iterator[dict[str, Any]]:
        """Every visible job, newest first, fetched page by page as iterated."""
        params: dict[str, Any] = {"limit": page_size}
        if status:
            params["status"] = status
        while True:
            page = self._request("GET", "/v1/jobs", params=params)
            yield from page["items"]
            if not page["next_cursor"]:
                return
            params["cursor"] = page["next_cursor"]

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a queued or running job; a finished job is refused (409 ``conflict``) and
        keeps its files."""
        job: dict[str, Any] = self._request("POST", f"/v1/jobs/{job_id}/cancel")
        return job

    def delete(self, job_id: str) -> dict[str, Any]:
        """``DELETE``: cancel an unfinished job, or remove a finished job's files (the job
        stays, with ``deleted_at``)."""
        job: dict[str, Any] = self._request("DELETE", f"/v1/jobs/{job_id}")
        return job

    # --- progress ----------------------------------------------------------------------------

    def events(self, job_id: str, last_event_id: int | None = None) -> Iterator[JobEvent]:
        """One connection to the job's event stream, until the server ends it."""
        headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
        url = f"/v1/jobs/{job_id}/events"
        try:
            with connect_sse(self._http, "GET", url, headers=headers) as source:
                if not source.response.is_success:
                    source.response.read()
                    _raise_for_problem(source.response)
                for sse in source.iter_sse():
                    if not sse.data:
                        continue  # keep-alive
                    yield JobEvent(kind=sse.event, version=int(sse.id), data=json.loads(sse.data))
        except (httpx.HTTPError, SSEError) as exc:
            raise self._unreachable(f"event stream of {job_id}", exc) from exc

    def follow(
        self, job_id: str, last_event_id: int | None = None, max_reconnects: int = 10
    ) -> Iterator[JobEvent]:
        """The job's events until its terminal one, reconnecting with ``Last-Event-ID`` when
        the connection drops (service restart, proxy timeout)."""
        backoff = _backoff(max_reconnects)
        while True:
            got_any = False
            try:
                for event in self.events(job_id, last_event_id):
                    got_any = True
                    backoff.succeeded()
                    last_event_id = event.version
                    yield event
                    if event.terminal:
                        return
            except ServiceUnreachable:
                if not backoff.failed():
                    raise
                continue
            if not got_any and self.job(job_id)["status"] in TERMINAL:
                return  # resumed after the final event: nothing left to say

    def wait(self, job_id: str, on_event: Callable[[JobEvent], None] | None = None) -> dict[str, Any]:
        """Block until the job ends; its final JSON."""
        for event in self.follow(job_id):
            if on_event is not None:
                on_event(event)
        return self.job(job_id)

    # --- artifacts ---------------------------------------------------------------------------

    def download(
        self,
        job: Mapping[str, Any],
        out_dir: Path,
        on_progress: DownloadProgress | None = None,
        retries: int = 5,
    ) -> list[Path]:
        """Every artifact of a succeeded job into ``out_dir``; files already there and intact
        are kept, partial ``.part`` files are resumed with ``Range``. Each file is checked
        against the size and sha256 of the job's artifact list before it gets its name."""
        if job.get("status") != "succeeded":
            raise ClientError(f"job {job.get('id')} is {job.get('status')}: no artifacts")
        if job.get("deleted_at"):
            raise ArtifactsDeleted(
                f"job {job.get('id')} succeeded, but its files were deleted at "
                f"{job['deleted_at']}: nothing to download (submit it again to remake them)"
            )
        paths = []
        for artifact in job["artifacts"]:
            target = _confined(out_dir, artifact["path"])
            paths.append(target)
            if target.is_file() and target.stat().st_size == artifact["size"] and (
                sha256_file(target) == artifact["sha256"]
            ):
                if on_progress is not None:
                    on_progress(artifact["path"], artifact["size"], artifact["size"])
                continue
            self._download_one(artifact, target, on_progress, retries)
        return paths

    def _download_one(
        self,
        artifact: Mapping[str, Any],
        target: Path,
        on_progress: DownloadProgress | None,
        retries: int,
    ) -> None:
        size: int = artifact["size"]
        part = target.with_name(target.name + ".part")
        validator = target.with_name(target.name + ".part.etag")
        target.parent.mkdir(parents=True, exist_ok=True)
        backoff = _backoff(retries)
        while True:
            offset = part.stat().st_size if part.exists() else 0
            # what the .part was cut from; without a record, the API's own ETag (the sha256)
            etag = validator.read_text() if validator.exists() else f'"{artifact["sha256"]}"'
            if offset > size:
                offset = 0
            try:
                if offset < size:
                    self._fetch_range(artifact, part, validator, offset, etag, on_progress)
                break
            except _ChangedSinceCut:
                continue  # the object changed since the .part was cut: restarted from 0
            except ServiceUnreachable:
                if not backoff.failed():
                    raise
        digest = sha256_file(part)
        validator.unlink(missing_ok=True)
        if part.stat().st_size != size or digest != artifact["sha256"]:
            part.unlink()
            raise ArtifactCorrupt(
                f"{artifact['path']}: got {digest}, expected {artifact['sha256']}; removed"
            )
        os.replace(part, target)

    def _fetch_range(
        self,
        artifact: Mapping[str, Any],
        part: Path,
        validator: Path,
        offset: int,
        etag: str,
        on_progress: DownloadProgress | None,
    ) -> None:
        """Append ``offset-`` to ``part``, or rewrite it whole when the server sends it whole.

        A resume names the ETag the ``.part`` was cut from (kept beside it in ``.part.etag``,
        as the server that answered sent it: the API's sha256, or an object store's own ETag
        behind the API's redirect) twice: ``If-Range``, so a server that honours it sends the
        whole new file when it changed, and ``If-Match``, so one that ignores ``If-Range``
        (S3: SeaweedFS, AWS) refuses with 412 instead of sending bytes of another object to
        splice onto ours; the ``.part`` is then dropped (:class:`_ChangedSinceCut`)."""
        headers = {}
        if offset:
            headers = {"Range": f"bytes={offset}-", "If-Range": etag, "If-Match": etag}
        try:
            # An artifact store answers with a redirect to a presigned URL; httpx drops the
            # Authorization header when the redirect leaves the API's origin and keeps the rest.
            with self._http.stream("GET", artifact["url"], headers=headers,
                                   follow_redirects=True) as response:
                if response.status_code == 412 and offset:
                    response.read()
                    part.unlink(missing_ok=True)
                    validator.unlink(missing_ok=True)
                    raise _ChangedSinceCut(artifact["path"])
                if not response.is_success:
                    response.read()
                    _raise_for_problem(response)
                mode = "ab" if response.status_code == 206 else "wb"
                done = offset if mode == "ab" else 0
                if mode == "wb":  # a new cut: remember what it is cut from before any byte
                    validator.unlink(missing_ok=True)
                    if response.headers.get("etag"):
                        validator.write_text(response.headers["etag"])
                with part.open(mode) as f:
                    for chunk in response.iter_bytes(CHUNK):
                        f.write(chunk)
                        done += len(chunk)
                        if on_progress is not None:
                            on_progress(artifact["path"], done, artifact["size"])
                    f.flush()
                    os.fsync(f.fileno())
        except httpx.HTTPError as exc:
            raise self._unreachable(f"download of {artifact['path']}", exc) from exc


class _ChangedSinceCut(Exception):
    """A resumed download's object is no longer the one its ``.part`` was cut from."""


def _backoff(retries: int) -> Backoff:
    """The client's pauses between attempts: 0.5 s, doubling, at most 5 s."""
    return Backoff(retries, base_seconds=0.5, cap_seconds=5.0)


def _confined(out_dir: Path, relative: str) -> Path:
    """``out_dir / relative``, refusing paths that would leave ``out_dir``."""
    pure = PurePosixPath(relative)
    if pure.is_absolute() or ".." in pure.parts or not pure.parts:
        raise ClientError(f"refusing artifact path {relative!r}")
    return out_dir.joinpath(*pure.parts)
