"""A MoE's GGUF export holds one block of experts, never a layer's whole expert stack.

llama.cpp's converter stacks a Mixtral layer's experts into one 3-D tensor; evaluated through
its lazy graph that is ``experts x intermediate x hidden`` float32 at once. The exporter
streams the stack one expert after the other (``TensorPlan.parts``), so the export's peak
RSS is the dense formula's: two Mixtral-shaped checkpoints whose stacks differ fourfold
(8 and 32 experts) peak within a row block of each other, and the file reads back equal to
the checkpoint (the exporter's read-back) in the layout llama.cpp's own converter plans.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.measure import run_measured
from tests.fixtures.moe import write_mixtral

CHILD = """
import json, sys
from pathlib import Path
from service.checkpoint import open_checkpoint
from service.config import Settings
from service.exporters.base import ExportInputs
from service.exporters.gguf import GGUFExporter, GGUFSpec
from service.stage import InMemoryContext
ckpt, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
ctx = InMemoryContext(Settings(data_dir=out / ".var"), out / ".work")
with open_checkpoint(ckpt) as c:
    result = GGUFExporter().export(GGUFSpec(type="f16"), ExportInputs(c), out, ctx)
print(json.dumps({"verification": result.summary["verification"],
                  "computed": result.summary["computed_tensors"],
                  "types": result.summary["tensor_types"]}))
"""

ROW_BLOCK = 64 << 20


def _export(ckpt: Path, out: Path) -> tuple[int, dict[str, object]]:
    log = out.with_suffix(".log")
    result = run_measured([sys.executable, "-c", CHILD, str(ckpt), str(out)], log)
    assert result["exit"] == 0, log.read_text()[-3000:]
    return int(result["peak_rss"]), json.loads(log.read_text().strip().splitlines()[-1])


@pytest.mark.timeout(900)
def test_a_mixtral_gguf_export_peaks_the_same_whatever_its_expert_stack(tmp_path: Path) -> None:
    peaks: dict[int, int] = {}
    stacks: dict[int, int] = {}
    reports: dict[int, dict[str, object]] = {}
    for experts in (8, 32):
        ckpt = tmp_path / f"mixtral-{experts}"
        summary = write_mixtral(ckpt, layers=1, experts=experts)
        stacks[experts] = int(summary["stack_bytes"])
        peaks[experts], reports[experts] = _export(ckpt, tmp_path / f"gguf-{experts}")
        (ckpt / "model.safetensors").unlink()
    grown = stacks[32] - stacks[8]
    assert grown > 4 * ROW_BLOCK
    assert peaks[32] - peaks[8] < ROW_BLOCK, (
        f"peak grew {(peaks[32] - peaks[8]) >> 20} MiB for {grown >> 20} MiB more expert stack: "
        f"8 experts {peaks[8] >> 20} MiB, 32 experts {peaks[32] >> 20} MiB"
    )
    for report in reports.values():
        verification = report["verification"]
        assert isinstance(verification, dict) and verification["read_back"]
        # token_embd, output_norm, output; per layer: attention (4), 2 norms, the router, 3 stacks
        assert verification["tensors_checked"] == 3 + 10
        assert report["computed"] == 2, "only the permuted q and k are evaluated whole"
