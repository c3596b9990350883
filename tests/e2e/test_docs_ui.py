"""``/docs`` and ``/redoc`` in a real headless Chromium with the network off: Swagger UI and
Redoc render the API from files the service itself serves, and the browser asks nothing of any
other host."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Route, expect

from tests.fixtures.browser import headless_chromium
from tests.fixtures.service import ServiceProcess, running_service


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    with running_service(tmp_path_factory.mktemp("docs")) as svc:
        yield svc


def test_docs_render_offline_from_the_services_own_files(
    service: ServiceProcess, tmp_path: Path
) -> None:
    elsewhere: list[str] = []

    def offline(route: Route) -> None:
        """The network is off: only the service on loopback answers."""
        if route.request.url.startswith(service.url):
            route.continue_()
        else:
            elsewhere.append(route.request.url)
            route.abort("internetdisconnected")

    with headless_chromium() as browser:
        context = browser.new_context()
        context.route("**/*", offline)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(f"{service.url}/docs")
        expect(page.locator(".swagger-ui .info .title")).to_contain_text("modelprep",
                                                                         timeout=60_000)
        submit = page.locator(".opblock-post", has_text="/v1/jobs").first
        expect(submit).to_be_visible()
        submit.locator(".opblock-summary").click()
        # the request body's examples, one per format
        expect(page.locator(".opblock-body select").first).to_be_visible(timeout=30_000)
        options = page.locator(".opblock-body select option").all_inner_texts()
        page.screenshot(path=str(tmp_path / "docs.png"))
        redoc = context.new_page()
        redoc.on("pageerror", lambda error: errors.append(str(error)))
        redoc.goto(f"{service.url}/redoc")
        expect(redoc.locator("h1").first).to_contain_text("modelprep", timeout=60_000)
        expect(redoc.get_by_text("Submit a job").first).to_be_attached()
        context.close()
    assert not elsewhere, f"/docs asked other hosts: {elsewhere}"
    assert not errors, errors
    for fmt in ("safetensors", "GGUF", "NNEF", "ONNX"):
        assert any(fmt.lower() in option.lower() for option in options), (fmt, options)
