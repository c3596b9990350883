"""Reading a GGUF back (``service.exporters.gguf.verify``): the read-back catches unpermuted q/k,
"verify": false checks only the layout, and llama.cpp's split files are checked by the read-back
(their split keys, their order, all of them given).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from transformers import LlamaForCausalLM

from service.checkpoint import open_checkpoint
from service.errors import VerificationFailed
from service.exporters.gguf.layout import GGUFPlan, add_metadata, layout_gguf
from service.exporters.gguf.verify import verify_gguf
from service.exporters.gguf.writer import write_gguf
from tests.fixtures.gguf_files import (
    IDS,
    export_gguf,
    gguf_ctx,
    gguf_forward,
    layout_of,
    reference_logits,
)


def test_without_qk_permutation_verification_fails(
    llama: tuple[Path, LlamaForCausalLM], tmp_path: Path
) -> None:
    """Negative control: the read-back check notices q/k rows in transformers' order."""

    ckpt_dir, model = llama
    path = tmp_path / "unpermuted.gguf"

    def unpermuted() -> GGUFPlan:
        plan = layout_of(ckpt_dir, "f32")
        names = {t.name: t for t in plan.tensors}
        assert names["blk.0.attn_q.weight"].compute is not None  # llama.cpp permutes it
        plain = {
            f"blk.{i}.attn_{w}.weight": f"model.layers.{i}.self_attn.{w}_proj.weight"
            for i in range(2)
            for w in "qk"
        }
        tensors = tuple(
            dataclasses.replace(t, source=plain[t.name], compute=None) if t.name in plain else t
            for t in plan.tensors
        )
        return dataclasses.replace(plan, tensors=tensors)

    with open_checkpoint(ckpt_dir) as ckpt:
        broken = unpermuted()
        write_gguf(path, broken, ckpt.reader, lambda w: add_metadata(w, broken), gguf_ctx(tmp_path))
        verify_gguf(path, unpermuted(), ckpt.reader, gguf_ctx(tmp_path))  # consistent with itself
        with pytest.raises(VerificationFailed, match=r"attn_[qk]\.weight"):
            verify_gguf(path, layout_of(ckpt_dir, "f32"), ckpt.reader, gguf_ctx(tmp_path))
    # ...and such a file does not run like the model under llama.cpp's rope.
    ref = reference_logits(model)
    assert np.abs(gguf_forward(path, IDS) - ref).max() / np.abs(ref).max() > 1e-2


def test_verify_false_checks_the_layout_and_reads_nothing_back(
    wide_llama: Path,
    tmp_path: Path,
) -> None:
    checked, _ = export_gguf(wide_llama, tmp_path / "checked", "q8_0")
    fast, ctx = export_gguf(wide_llama, tmp_path / "fast", "q8_0", verify=False)
    assert checked.digests == fast.digests  # same bytes either way
    assert checked.summary["verification"]["read_back"] is True
    assert checked.summary["verification"]["tensors_checked"] == checked.summary["tensors"]
    assert fast.summary["verification"] == {
        "read_back": False, "files": 1, "tensors_checked": 0,
        "max_abs_error": {}, "worst_fraction_of_bound": {},
    }  # fmt: skip
    assert ctx.total == ctx.done  # one pass announced, one pass done


def test_split_layout_is_checked_by_the_read_back(
    wide_llama: Path,
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    result, _ = export_gguf(wide_llama, out, "f16", max_shard_size=600_000)
    files = [out / n for n in result.files]
    n = len(files)
    assert n >= 3 and result.files == [
        f"model-f16-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)
    ]
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == result.files
    with open_checkpoint(wide_llama) as c:
        plan = layout_gguf(wide_llama, c.config, c.reader, "f16", pre_tokenizer_fallback="default")
        report = verify_gguf(files, plan, c.reader, gguf_ctx(tmp_path))
        assert report.files == len(files) and report.tensors_checked == len(plan.tensors)
        with pytest.raises(Exception, match="split keys"):
            verify_gguf(files[::-1], plan, c.reader, gguf_ctx(tmp_path), read_back=False)
        with pytest.raises(Exception, match="split.count"):
            verify_gguf(files[0], plan, c.reader, gguf_ctx(tmp_path), read_back=False)
