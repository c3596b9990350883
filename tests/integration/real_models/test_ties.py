"""A tied embedding stored under either name, or both, goes through every exporter; an untied
model stays untied. Tiny real Llama (transformers' own class), so this runs in seconds."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from service.config import Settings
from service.jobs.layout import JobLayout
from service.jobs.pipeline import run_pipeline
from service.jobs.spec import JobSpec
from service.stage import InMemoryContext
from tests.fixtures.models import build_tiny_llama, save_checkpoint

EXPORTS = [{"format": "safetensors"}, {"format": "gguf", "type": "f32"}, {"format": "nnef"}]


def _tied_checkpoint(root: Path, stored: str) -> Path:
    model = build_tiny_llama(tie_word_embeddings=True)
    out = save_checkpoint(model, root / stored)  # save_pretrained: input name only
    state = load_file(out / "model.safetensors")
    embed = state.pop("model.embed_tokens.weight")
    names = {"input": ["model.embed_tokens.weight"], "output": ["lm_head.weight"],
             "both": ["model.embed_tokens.weight", "lm_head.weight"]}[stored]
    state.update({n: embed.clone() for n in names})
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _run(tmp_path: Path, source: Path) -> tuple[Path, dict[str, object]]:
    settings = Settings(data_dir=tmp_path / "data", local_roots=[source.parent])
    layout = JobLayout.for_job(settings, "f" * 32)
    layout.prepare()
    ctx = InMemoryContext(settings=settings, work_dir=layout.work, job_id="f" * 32)
    spec = JobSpec.model_validate({"source": f"file://{source}", "exports": EXPORTS})
    run_pipeline(spec, ctx, layout)
    return layout.artifacts, json.loads((layout.artifacts / "manifest.json").read_text())


@pytest.mark.parametrize("stored", ["input", "output", "both"])
def test_a_tied_embedding_under_any_name_exports_everywhere_and_stays_tied(
    stored: str, tmp_path: Path
) -> None:
    source = _tied_checkpoint(tmp_path / "models", stored)
    artifacts, manifest = _run(tmp_path, source)
    exports = {e["format"]: e for e in manifest["exports"]}  # type: ignore[attr-defined]
    assert set(exports) == {"safetensors", "gguf", "nnef"}
    embed = build_tiny_llama(tie_word_embeddings=True).model.embed_tokens.weight.detach()
    reader = gguf.GGUFReader(next((artifacts / "gguf").glob("*.gguf")))
    tensors = {t.name: t for t in reader.tensors}
    assert torch.equal(torch.from_numpy(tensors["token_embd.weight"].data.copy()), embed)
    written = load_file(artifacts / "safetensors" / "model.safetensors")
    assert torch.equal(written["model.embed_tokens.weight"], embed)


def test_an_untied_model_stays_untied_in_gguf(tmp_path: Path) -> None:
    source = save_checkpoint(build_tiny_llama(), tmp_path / "models" / "untied")
    artifacts, _ = _run(tmp_path, source)
    reader = gguf.GGUFReader(next((artifacts / "gguf").glob("*.gguf")))
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    assert not torch.equal(tensors["output.weight"], tensors["token_embd.weight"])
