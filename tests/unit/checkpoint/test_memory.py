"""A full pass over a checkpoint leaves no file pages resident: RSS grows by one tensor at most."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import save_file

from service.checkpoint import open_checkpoint

TENSOR_MB = 16
COUNT = 6


def _rss_file_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


@pytest.fixture(scope="module")
def big_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n = TENSOR_MB * 1024 * 1024 // 4
    return {f"layer{i}.weight": torch.randn(n, generator=gen) for i in range(COUNT)}


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_reading_every_tensor_keeps_file_pages_out_of_rss(
    tmp_path: Path, big_state: dict[str, torch.Tensor], fmt: str
) -> None:
    if fmt == "bin":
        torch.save(big_state, tmp_path / "pytorch_model.bin")
    else:
        save_file(big_state, tmp_path / "model.safetensors")
    proc = psutil.Process()
    with open_checkpoint(tmp_path) as ckpt:
        file_before, rss_before = _rss_file_kib(), proc.memory_info().rss
        peak = 0
        for info in ckpt.reader.tensor_infos():
            tensor = ckpt.reader.read(info.name)
            assert torch.equal(tensor, big_state[info.name])
            del tensor
            for _chunk in ckpt.reader.iter_chunks(info.name, 1 << 20):
                pass
            peak = max(peak, proc.memory_info().rss - rss_before)
        file_growth_mib = (_rss_file_kib() - file_before) / 1024
    total_mib = TENSOR_MB * COUNT
    assert file_growth_mib < TENSOR_MB / 2, f"{file_growth_mib:.0f} MiB of file pages resident"
    assert peak < (2 * TENSOR_MB + 8) * 1024 * 1024 < total_mib * 1024 * 1024
