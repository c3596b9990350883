"""The assumptions service.shims.huggingface_hub makes about huggingface_hub, each named in
the failure message so that an upgrade that breaks one says which."""

from __future__ import annotations

import inspect
import socket
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download
from tqdm.std import tqdm

from service.config import Settings
from service.shims.huggingface_hub import (
    TransportError,
    filter_repo_objects,
    job_progress_bar,
    validate_repo_id,
)
from service.stage import InMemoryContext


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def test_a_refused_connection_raises_the_hub_clients_transport_error() -> None:
    api = HfApi(endpoint=f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(Exception) as caught:
        api.model_info("org/model")
    assert isinstance(caught.value, TransportError), (
        "assumption broken: huggingface_hub.utils.httpx.TransportError is what the hub client "
        f"raises on a network failure (got {type(caught.value).__mro__})"
    )


def test_filter_repo_objects_and_validate_repo_id_keep_their_public_behaviour() -> None:
    files = ["config.json", "model.safetensors", "sub/model.safetensors", "README.md"]
    assert sorted(filter_repo_objects(files, allow_patterns=["*.json", "*.safetensors"])) == [
        "config.json", "model.safetensors", "sub/model.safetensors",
    ], "assumption broken: filter_repo_objects matches fnmatch patterns across '/'"  # fmt: skip
    validate_repo_id("org/model")
    with pytest.raises(ValueError, match="Repo id"):
        validate_repo_id("../escape")


def test_hf_hub_download_takes_a_tqdm_class_and_ours_reports_bytes(tmp_path: Path) -> None:
    params = inspect.signature(hf_hub_download).parameters
    assert "tqdm_class" in params, "assumption broken: hf_hub_download(tqdm_class=...) exists"
    ctx = InMemoryContext(settings=Settings(data_dir=tmp_path), work_dir=tmp_path)
    bar_type = job_progress_bar(ctx)
    assert issubclass(bar_type, tqdm)
    bar = bar_type(total=100, unit="B", name="huggingface_hub.xet")  # the hub passes name=
    bar.update(60)
    bar.update(40)
    assert (ctx.done, bar.n, bar.format_dict["total"]) == (100, 100, 100)
    bar.close()
    ctx.cancel_event.set()
    with pytest.raises(Exception, match="cancelled"):
        bar_type(total=1).update(1)


def test_the_client_given_to_set_client_factory_is_built_as_the_hubs_own() -> None:
    """client_factory mirrors default_client_factory (its request hook, redirects followed, no
    timeout of its own) with a transport of ours: an upgrade that changes the default must
    change it too."""
    from huggingface_hub.utils import _http as hub_http

    from service.egress import EgressPolicy
    from service.shims.huggingface_hub import client_factory

    default = hub_http.default_client_factory()
    ours = client_factory(lambda scheme, host: None, EgressPolicy().ssl_context())()
    try:
        for name in ("follow_redirects", "timeout", "event_hooks"):
            assert getattr(ours, name) == getattr(default, name), (
                f"assumption broken: huggingface_hub's default client's {name} is "
                f"{getattr(default, name)!r}, client_factory builds {getattr(ours, name)!r}"
            )
    finally:
        ours.close()
        default.close()


def test_after_keep_downloads_on_client_no_download_goes_to_hf_xet() -> None:
    import huggingface_hub.constants as hub_constants
    from huggingface_hub import file_download
    from huggingface_hub.file_download import is_xet_available

    from service.shims.huggingface_hub import keep_downloads_on_client

    saved = hub_constants.HF_HUB_DISABLE_XET
    try:
        hub_constants.HF_HUB_DISABLE_XET = False
        assert is_xet_available(), "hf_xet is installed, so the hub would use it by default"
        keep_downloads_on_client()
        assert not is_xet_available(), (
            "assumption broken: huggingface_hub.file_download.is_xet_available() reads "
            "constants.HF_HUB_DISABLE_XET at each call"
        )
        source = inspect.getsource(file_download._download_to_tmp_and_move)
        assert "xet_file_data is not None and is_xet_available()" in source, (
            "assumption broken: a download goes to hf_xet only when is_xet_available() says so"
        )
    finally:
        hub_constants.HF_HUB_DISABLE_XET = saved
