"""llama-quantize in row blocks (its ``--max-buffer-size``, the service's ``quantizer_buffer``)
writes the very bytes it writes converting each tensor whole, its own default.

The assumption this names: **ggml quantizes every row on its own** (an importance matrix is per
column, the same for every row of a tensor or of one expert), so converting a tensor to float32
and quantizing it a block of rows at a time cannot change a byte. The pinned llama.cpp relies on
it (``src/llama-quant.cpp``: slabs of ``max_buf_size``, 8 GiB by default, so a whole tensor at
any width but a 70B model's embedding); the service passes a far smaller block so that no
float32 copy of a whole tensor is ever made. If a llama.cpp update made a type's rows depend on
each other, or the slabs cross a row, these tests fail.

The tensors here are wider than the 1 MiB block (a 4096-row MLP of 256 columns: 6.6 MiB of
f16, float32 and Q4_K per tensor), so every run of the small block really converts in several
blocks; each K-quant file is then compared with the tool's default run, and the Q8_0 file with
gguf-py's own Q8_0 (llama.cpp's reference quantization re-written in numpy), an independent
reading of the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from service.exporters.common.child_process import ChildPeaks, run_child
from service.exporters.gguf.quantize import buffer_argv, compute_imatrix, quantize
from service.fsutil import sha256_file
from service.shims.llama_cpp import TOOL_ENV, llama_cpp_tool
from tests.fixtures.gguf_files import export_gguf
from tests.fixtures.models import save_random_causal_lm
from tests.integration.exporters.gguf.conftest import wide_llama_config
from tests.integration.exporters.gguf.test_quantize import CALIBRATION

MiB = 1 << 20
BLOCK = MiB
"""The smallest block llama-quantize takes (whole MiB)."""
WHOLE = 8192 * MiB
"""llama-quantize's own default block: every tensor here converted whole."""
OUT_BYTES = {"Q4_K_M": 0.82, "IQ4_XS": 0.82, "Q8_0": 34 / 32}
"""The most a type's mixture writes per weight (its Q6_K or Q8_0 tensors)."""


@pytest.fixture(scope="module")
def f16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer Llama with a 4096-wide MLP, exported to f16 by the service's own writer."""
    root = tmp_path_factory.mktemp("quantize-blocks")
    save_random_causal_lm(wide_llama_config(1, intermediate_size=4096), root / "ckpt", seed=3)
    result, _ = export_gguf(root / "ckpt", root / "f16", "f16", verify=False)
    return root / "f16" / result.files[0]


def _run(f16: Path, dest: Path, type_: str, block: int | None, imatrix: Path | None = None,
         ) -> tuple[str, ChildPeaks]:  # fmt: skip
    """llama-quantize of the pinned llama.cpp by hand, its rows in blocks of ``block`` bytes
    (None: without the option, the tool's own default); the file's sha256 and the child's
    peaks."""
    argv = [str(llama_cpp_tool("llama-quantize")), *(buffer_argv(block) if block else [])]
    argv += [*(["--imatrix", str(imatrix)] if imatrix else []), str(f16), str(dest), type_, "2"]
    peaks = run_child(argv, dest.parent, "llama-quantize", env=TOOL_ENV, timeout=300)
    return sha256_file(dest), peaks


def _blocks(f16: Path, type_: str, block: int) -> int:
    """How many row blocks llama-quantize's slab rule makes of the file's widest-held tensor
    (``nrows_slab = block / (f16 row + quantized row + float32 row)``)."""
    most = 1
    for tensor in gguf.GGUFReader(f16).tensors:
        if len(tensor.shape) < 2:
            continue
        n, rows = int(tensor.shape[0]), int(np.prod(tensor.shape[1:]))
        per_row = n * (2 + 4 + OUT_BYTES[type_])
        most = max(most, -(-rows // max(1, int(block // per_row))))
    return most


@pytest.mark.parametrize("type_", ["Q4_K_M", "Q8_0"])
def test_a_quantization_in_1_mib_row_blocks_is_the_whole_tensor_file_byte_for_byte(
    f16: Path, tmp_path: Path, type_: str
) -> None:
    assert _blocks(f16, type_, BLOCK) >= 6, "no tensor is wider than the block: nothing tested"
    assert _blocks(f16, type_, WHOLE) == 1
    whole, whole_peaks = _run(f16, tmp_path / "whole.gguf", type_, None)
    blocked, blocked_peaks = _run(f16, tmp_path / "blocked.gguf", type_, BLOCK)
    assert blocked == whole
    print(f"{type_} anonymous peak: whole {whole_peaks.anon}, 1 MiB blocks {blocked_peaks.anon}")


def test_the_service_s_quantizer_passes_its_block_and_writes_the_tool_s_default_bytes(
    f16: Path, tmp_path: Path
) -> None:
    whole, _ = _run(f16, tmp_path / "whole.gguf", "Q4_K_M", None)
    run = quantize(f16, tmp_path / "service.gguf", "q4_k_m", tmp_path, lambda: None,
                   lambda n: None, 1, buffer_bytes=BLOCK)  # fmt: skip
    assert run.digest == whole


def test_an_imatrix_quantization_in_row_blocks_is_the_whole_tensor_file_byte_for_byte(
    f16: Path, tmp_path: Path
) -> None:
    # llama-imatrix is not bit-reproducible from run to run: one matrix for both runs
    imatrix = compute_imatrix(f16, CALIBRATION, tmp_path, lambda: None)
    whole, _ = _run(f16, tmp_path / "whole.gguf", "IQ4_XS", None, imatrix)
    blocked, _ = _run(f16, tmp_path / "blocked.gguf", "IQ4_XS", BLOCK, imatrix)
    assert blocked == whole
    plain, _ = _run(f16, tmp_path / "plain.gguf", "IQ4_XS", BLOCK)
    assert plain != blocked, "the importance matrix was not used"


def test_q8_0_in_row_blocks_is_gguf_py_s_q8_0_of_the_same_f16(f16: Path, tmp_path: Path) -> None:
    _run(f16, tmp_path / "q8.gguf", "Q8_0", BLOCK)
    source = {t.name: t for t in gguf.GGUFReader(f16).tensors}
    compared = 0
    for tensor in gguf.GGUFReader(tmp_path / "q8.gguf").tensors:
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q8_0:
            continue
        values = np.asarray(source[tensor.name].data, dtype=np.float32)
        expected = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
        assert expected.tobytes() == np.asarray(tensor.data).tobytes(), tensor.name
        compared += 1
    assert compared >= 7, compared  # every matrix: q k v o gate up down (embedding, output)
