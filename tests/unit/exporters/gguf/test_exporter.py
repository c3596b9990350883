"""The GGUF exporter's checks at submission that need no llama.cpp (``service.exporters.gguf.exporter``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.api.errors import http_status
from service.config import Settings
from service.errors import SourceNotAllowed
from tests.conftest import TinyCheckpointFactory


def test_an_imatrix_outside_the_allowed_sources_is_refused_at_submission(
    tiny_checkpoint: TinyCheckpointFactory, tmp_path: Path
) -> None:
    from service.jobs.service import check_spec
    from service.jobs.spec import JobSpec

    ckpt_dir = tiny_checkpoint("llama", "safetensors")
    outside = tmp_path / "elsewhere" / "imatrix.gguf"
    outside.parent.mkdir()
    outside.write_bytes(b"GGUF")  # it exists: refused for where it is
    spec = JobSpec.model_validate(
        {"source": f"file://{ckpt_dir}", "exports": [
            {"format": "gguf", "type": "Q4_K_M", "imatrix": {"uri": f"file://{outside}"}}]}
    )  # fmt: skip
    settings = Settings(data_dir=tmp_path / "var", local_roots=[ckpt_dir])
    with pytest.raises(SourceNotAllowed) as info:
        check_spec(spec, settings, None, config_known=False)  # judged even for a remote model
    assert http_status(info.value) == 422
