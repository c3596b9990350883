"""The NNEF plan's job term, on headers alone: the weights are read a block at a time
(``MODELPREP_NNEF_BLOCK_BYTES``: each ``.dat`` written, a large weight embedded or multiplied),
so the term is a block and its cast, never a whole tensor, at Llama-3-70B and 405B widths."""

from __future__ import annotations

from dataclasses import replace

from service.checkpoint.headers import CheckpointHeaders
from service.config import Settings
from service.exporters import plan_export
from service.exporters.nnef.plan import (
    NNEF_BLOCK_BYTES,
    NNEF_PER_LAYER_BYTES,
    Q4_0_LARGEST_COPIES,
    nnef_block_limit,
)
from service.plan.terms import JOB_BASE_BYTES
from service.shims.torch_to_nnef import WRITE_BLOCK_BYTES
from tests.unit.plan.test_plan import GiB, MiB, llama, spec

LLAMA_3_70B = {"hidden": 8192, "inter": 28672}
LLAMA_3_1_405B = {"hidden": 16384, "inter": 53248}


def _llama3(hidden: int, inter: int, dtype: str = "BF16") -> CheckpointHeaders:
    """One layer at Llama 3 widths (vocabulary 128256)."""
    return llama(1, hidden=hidden, inter=inter, vocab=128256, dtype=dtype)


def test_the_jobs_weight_term_is_a_block_and_its_cast_flat_at_70b_and_405b_widths() -> None:
    """The embedding is 4008 MiB in float32 at 70B widths (the former "2 x largest tensor":
    8016 MiB), twice that at 405B: the term is 64 MiB read + its 128 MiB float32 cast at both."""
    wide, wider = _llama3(**LLAMA_3_70B), _llama3(**LLAMA_3_1_405B)
    a, b = (plan_export(spec("nnef"), h, GiB, verify=False) for h in (wide, wider))
    term = NNEF_BLOCK_BYTES + 2 * NNEF_BLOCK_BYTES  # bfloat16 read, float32 written
    assert a.job_peak_rss_bytes == b.job_peak_rss_bytes
    assert a.job_peak_rss_bytes == JOB_BASE_BYTES + term + NNEF_PER_LAYER_BYTES
    assert a.job_peak_rss_bytes < GiB
    assert (
        "a block of the largest tensor 64 MiB + its cast 128 MiB (largest tensor 4008 MiB"
        in (a.notes[0])
    )
    assert "(largest tensor 8016 MiB in the archive" in b.notes[0]
    # float16 stays float16, float32 stays float32: the block is written as read
    for dtype in ("F16", "F32"):
        same = plan_export(spec("nnef"), _llama3(**LLAMA_3_70B, dtype=dtype), GiB, verify=False)
        assert same.job_peak_rss_bytes == JOB_BASE_BYTES + NNEF_BLOCK_BYTES + NNEF_PER_LAYER_BYTES


def test_a_verified_export_plans_the_same_memory_at_70b_and_405b_widths() -> None:
    """With tract's check block by block, every NNEF term of the plan (the job's and tract's)
    is a block: the same figures at either width, within a 2.5 GiB service (606 MiB for the
    job, 576 MiB for tract)."""
    settings = Settings(memory_limit=int(2.5 * GiB))
    a, b = (
        plan_export(spec("nnef"), _llama3(**widths), GiB, settings=settings)
        for widths in (LLAMA_3_70B, LLAMA_3_1_405B)
    )
    assert a.verification == b.verification == "layerwise"
    assert a.job_peak_rss_bytes == b.job_peak_rss_bytes < GiB
    assert a.children == b.children
    (tract,) = a.children
    assert a.job_rss_during_children_bytes + tract.peak_rss_bytes < 2.5 * GiB / 2
    assert "a block of the largest tensor 64 MiB + its cast 128 MiB" in a.notes[0]


def test_the_block_is_the_setting_and_the_tensor_below_it() -> None:
    wide = _llama3(**LLAMA_3_70B)
    settings = Settings(nnef_block_bytes="256MiB")
    assert nnef_block_limit(settings) == 256 * MiB
    assert nnef_block_limit(None) == nnef_block_limit(Settings()) == NNEF_BLOCK_BYTES
    assert NNEF_BLOCK_BYTES == WRITE_BLOCK_BYTES  # one figure: the shim's default is the plan's
    bigger = plan_export(spec("nnef"), wide, GiB, verify=False, settings=settings)
    default = plan_export(spec("nnef"), wide, GiB, verify=False)
    assert bigger.job_peak_rss_bytes - default.job_peak_rss_bytes == 3 * (256 - 64) * MiB
    small = llama(2, hidden=256, inter=512, vocab=1000, dtype="BF16")  # 500 KB embedding
    plan = plan_export(spec("nnef"), small, GiB, verify=False)
    largest = 1000 * 256 * 2
    expected = JOB_BASE_BYTES + largest + 2 * largest + 2 * NNEF_PER_LAYER_BYTES
    assert plan.job_peak_rss_bytes == expected


def test_q4_0_and_expert_stacks_keep_their_whole_weight_terms() -> None:
    """torch-to-nnef's q4_0 quantizes each Linear weight whole, and a mixture of experts'
    forward indexes its packed stacks whole: both say so in the plan."""
    wide = _llama3(**LLAMA_3_70B)
    q4 = plan_export(spec("nnef", compression="q4_0"), wide, GiB, verify=False)
    head = 128256 * 8192 * 4
    assert (
        q4.job_peak_rss_bytes == JOB_BASE_BYTES + Q4_0_LARGEST_COPIES * head + NNEF_PER_LAYER_BYTES
    )
    assert "q4_0 quantizes whole weights" in q4.notes[0]
    moe = llama(2, experts=8)
    stack = 2 * 8 * 5632 * 2048 * 4  # gate and up, packed
    plan = plan_export(spec("nnef"), moe, GiB, verify=False)
    assert plan.job_peak_rss_bytes == JOB_BASE_BYTES + 2 * stack + 2 * NNEF_PER_LAYER_BYTES
    assert "expert stack" in plan.notes[0]
    tied = replace(wide, config={**(wide.config or {}), "tie_word_embeddings": True})
    assert plan_export(spec("nnef"), tied, GiB, verify=False).job_peak_rss_bytes == (
        plan_export(spec("nnef"), wide, GiB, verify=False).job_peak_rss_bytes
    )
