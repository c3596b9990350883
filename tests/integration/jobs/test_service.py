"""Submission's checks of a spec (``service.jobs.service.check_spec``) with the exporters'
own: GGUF's needs the built llama.cpp's converter to judge an architecture."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import Settings
from service.errors import UnsupportedExport
from service.jobs.service import check_spec
from service.jobs.spec import JobSpec


def test_exports_are_judged_at_submission_only_when_the_config_is_at_hand(
    tmp_path: Path,
) -> None:
    settings = Settings(data_dir=tmp_path)
    hub = JobSpec.model_validate({"source": "hf://org/tiny", "exports": [{"format": "nnef"}]})
    check_spec(hub, settings, None, config_known=False)  # not downloaded yet: judged in the job
    with pytest.raises(UnsupportedExport):
        check_spec(hub, settings, None, config_known=True)  # known to have no config.json
    whisper = {"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"]}
    gguf = JobSpec.model_validate({"source": "hf://org/tiny", "exports": [{"format": "gguf"}]})
    with pytest.raises(UnsupportedExport):
        check_spec(gguf, settings, whisper, config_known=True)
