"""What the hub source (:mod:`service.sources.hub`) relies on beyond huggingface_hub's API.

``filter_repo_objects`` (the hub's own pattern matching), ``validate_repo_id`` and
``build_hf_headers`` (the auth headers of a request the source makes itself) are used
through their public names in ``huggingface_hub.utils``, re-exported here only because mypy
does not see them as exported there.

Assumptions (checked by tests/unit/shims/test_huggingface_hub.py; huggingface_hub capped in
pyproject.toml):

* ``huggingface_hub.utils.httpx`` is the HTTP client module the hub client raises from (httpx2
  in huggingface_hub 2.x): a network failure is its ``TransportError``, which the source
  retries. Reached through that exported name, so modelprep imports no second HTTP client.
* ``set_client_factory`` (public) takes a function returning the client every hub call shares;
  :func:`client_factory` builds it as ``default_client_factory`` does (its request hook
  ``hf_request_event_hook``, a private name: the offline check, request ids, the download
  counter; redirects followed; no timeout of its own), with a transport of ours that sends each
  request directly or through the service's proxy and verifies TLS with its CA bundle.
* ``hf_hub_download(tqdm_class=...)`` instantiates the class with tqdm's arguments and calls
  ``update(n)`` with bytes, for plain HTTP and Xet downloads alike; the Xet reporter reads
  ``total`` and ``format_dict``, so the class is a real, enabled ``tqdm.std.tqdm`` (tqdm is
  declared because we subclass it; huggingface_hub's own subclass would disable itself under
  ``HF_HUB_DISABLE_PROGRESS_BARS`` and hide a job's progress).
* ``is_xet_available()`` (``huggingface_hub.utils._runtime``) reads ``constants.HF_HUB_DISABLE_XET`` at each
  call, and a download goes to ``hf_xet`` only when it says True: :func:`keep_downloads_on_client`
  sets that constant so every byte goes through the client above. hf_xet is a Rust client with
  its own connections: it would bypass the egress policy, the proxy and the CA bundle.
"""

from __future__ import annotations

import io
import ssl
from collections.abc import Callable
from typing import Any

import huggingface_hub.constants as hub_constants
import huggingface_hub.utils as hub_utils
from huggingface_hub.utils import _http as hub_http
from tqdm.std import tqdm

from service.stage import JobContext

__all__ = [
    "TransportError",
    "build_hf_headers",
    "client_factory",
    "filter_repo_objects",
    "job_progress_bar",
    "keep_downloads_on_client",
    "validate_repo_id",
]

# Public names of huggingface_hub.utils (in its __all__) that mypy does not see as exported.
filter_repo_objects = hub_utils.filter_repo_objects  # type: ignore[attr-defined]
validate_repo_id = hub_utils.validate_repo_id  # type: ignore[attr-defined]
build_hf_headers = hub_utils.build_hf_headers  # type: ignore[attr-defined]
TransportError: type[Exception] = hub_utils.httpx.TransportError  # type: ignore[attr-defined]
"""A network failure of the hub client (connection refused or reset, timeout)."""
set_client_factory = hub_utils.set_client_factory  # type: ignore[attr-defined]
_http: Any = hub_utils.httpx  # type: ignore[attr-defined]
_BaseTransport: Any = _http.BaseTransport


class _ProxyChoice(_BaseTransport):  # type: ignore[misc]  # the hub's httpx, typed Any here
    """Sends each request directly or through the proxy ``choose(scheme, host)`` names."""

    def __init__(self, choose: Callable[[str, str], str | None], verify: ssl.SSLContext) -> None:
        self._choose = choose
        self._verify = verify
        self._direct = _http.HTTPTransport(verify=verify)
        self._proxied: dict[str, Any] = {}

    def handle_request(self, request: Any) -> Any:
        proxy = self._choose(request.url.scheme, request.url.host)
        if proxy is None:
            return self._direct.handle_request(request)
        if proxy not in self._proxied:
            self._proxied[proxy] = _http.HTTPTransport(proxy=proxy, verify=self._verify)
        return self._proxied[proxy].handle_request(request)

    def close(self) -> None:
        self._direct.close()
        for transport in self._proxied.values():
            transport.close()


def client_factory(
    choose: Callable[[str, str], str | None], verify: ssl.SSLContext
) -> Callable[[], Any]:
    """What to hand ``set_client_factory``: huggingface_hub's own client, whose connections
    go through the proxy ``choose(scheme, host)`` names (None: directly), verified with
    ``verify``."""

    def make() -> Any:
        return _http.Client(
            event_hooks={"request": [hub_http.hf_request_event_hook]},
            follow_redirects=True, timeout=None, transport=_ProxyChoice(choose, verify),
        )

    return make


def keep_downloads_on_client() -> None:
    """Xet-stored files are downloaded over the hub's HTTP bridge by the shared client, not by
    ``hf_xet``, whose own connections would leave the egress policy, the proxy and the CA
    bundle behind (it reads none of them). The cost is Xet's chunk deduplication across
    revisions; a job downloads each file once anyway."""
    hub_constants.HF_HUB_DISABLE_XET = True


class _NullFile(io.TextIOBase):
    def write(self, s: str) -> int:
        return len(s)


class _JobProgress(tqdm):  # type: ignore[misc]  # tqdm ships no type information
    """The progress bar ``huggingface_hub`` updates while downloading: bytes go to the job's
    progress and every update is a cancellation point. Writes nowhere."""

    ctx: JobContext | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)
        kwargs.update(file=_NullFile(), disable=False, mininterval=1.0)
        super().__init__(*args, **kwargs)

    def update(self, n: float | None = 1) -> bool | None:
        if self.ctx is not None:
            self.ctx.check_abort()
            self.ctx.advance(int(n or 0))
        result: bool | None = super().update(n)
        return result


def job_progress_bar(ctx: JobContext | None) -> type[Any]:
    """The ``tqdm_class`` to hand ``hf_hub_download``: reports into ``ctx`` (None: nowhere)."""
    return type("JobProgress", (_JobProgress,), {"ctx": ctx})
