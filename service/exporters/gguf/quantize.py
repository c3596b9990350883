"""K-quants and IQ4 types by llama.cpp's own ``llama-quantize``, run in a child process.

K-quant math and llama-quantize's per-tensor mixtures (Q4_K_M keeps half of ``ffn_down`` and
``attn_v`` at Q6_K, the output at Q6_K, falls back for rows not a multiple of 256...) are
llama.cpp's to maintain: re-deriving them would only drift. The exporter streams an f16 GGUF
into the job's work directory (bounded memory, verified against the source), then this module
runs ``llama-imatrix`` (optional) and ``llama-quantize`` on it as children: progress is read
from the tool's log ("[  12/ 291] blk.1.attn_q.weight ..."), a cancel kills the child, a deadline
bounds it, and a failure is a typed :class:`~service.errors.ExportFailed`. The child's RSS is its
own (``run_child`` measures it apart from the job's) and is returned once it exits, so the job process never holds more
than the writer's row block.

llama-quantize itself converts each tensor to float32 and quantizes it in row blocks of at most
``--max-buffer-size`` (the pinned llama.cpp's ``max_buf_size``: f16 rows in, their float32
copy, the quantized rows out; 8 GiB by default, i.e. a whole tensor). The service passes
``quantizer_buffer`` (256 MiB by default), so no tensor is held whole in float32: a 70B
model's 1.05 G-element embedding would be 4 GiB. The file is the same bytes whatever the
block, as ggml quantizes row by row and an imatrix is per column
(``tests/integration/exporters/gguf/test_quantize_blocks.py`` holds llama.cpp to that).
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.config import QUANTIZER_BUFFER
from service.errors import ExportFailed, ImatrixNotValid, VerificationFailed
from service.exporters.common.child_process import ChildPeaks, run_child
from service.exporters.gguf.spec import QUANTIZER_TYPES
from service.fsutil import sha256_file
from service.shims.llama_cpp import TOOL_ENV, llama_cpp_tool
from service.stage import JobContext, SideContext

if TYPE_CHECKING:
    from service.exporters.gguf.spec import GGUFImatrix

TOOL_TIMEOUT = 6 * 3600.0
"""Seconds a quantizer child may run: a 70B model quantizes in well under an hour on 2 cores;
past this it is stuck, and a stuck child must not hold a worker slot for ever."""

_PROGRESS = re.compile(rb"\[\s*(\d+)/\s*(\d+)\]")


@dataclass(frozen=True)
class QuantizeRun:
    digest: str
    """sha256 of the quantized file."""
    peaks: ChildPeaks
    """The llama-quantize child's peak RSS (the pages of the file it reads included) and its
    anonymous peak."""


class _LogProgress:
    """Turns the tool's "[ i/ n]" lines into ``advance`` calls, polled while it runs."""

    def __init__(self, log: Path, units: int, advance: Callable[[int], None]) -> None:
        self.log, self.units, self.advance = log, units, advance
        self.offset = self.reported = 0

    def poll(self) -> None:
        try:
            with open(self.log, "rb") as f:
                f.seek(max(0, self.offset - 64))  # a line split across two polls is re-read
                chunk = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return
        found = _PROGRESS.findall(chunk)
        if found:
            i, n = (int(x) for x in found[-1])
            self._to(self.units * i // max(1, n))

    def finish(self) -> None:
        """The child exited successfully: whatever its last lines said, the pass is done."""
        self._to(self.units)

    def _to(self, done: int) -> None:
        if done > self.reported:
            self.advance(done - self.reported)
            self.reported = done


def compute_imatrix(
    source: Path,
    calibration: str,
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None = None,
    ctx_size: int = 128,
) -> Path:
    """llama-imatrix over ``calibration`` on the f16 file; returns the imatrix file it wrote.

    The context is short (``ctx_size`` tokens) so that a calibration text of a few paragraphs
    makes several chunks; too short a text is the tool's error, surfaced as ExportFailed."""
    tool = llama_cpp_tool("llama-imatrix", bin_dir)
    text = work / "calibration.txt"
    text.write_text(calibration, encoding="utf-8")
    out = work / "imatrix.gguf"
    argv = [str(tool), "-m", str(source), "-f", str(text), "-o", str(out),
            "-c", str(ctx_size), "-b", str(ctx_size), "-t", str(_threads()),
            "--no-ppl"]  # fmt: skip
    run_child(
        argv, work, "llama-imatrix", check_abort, TOOL_ENV,
        log=work / "imatrix.log", timeout=TOOL_TIMEOUT, error=ExportFailed,
    )  # fmt: skip
    if not out.is_file():
        raise ExportFailed("llama-imatrix wrote no importance matrix (calibration text too short?)")
    return out


def fetch_imatrix(spec: GGUFImatrix, ctx: JobContext) -> tuple[Path, dict[str, Any]]:
    """The imatrix file of ``spec.uri``, fetched like a model source and checked to be one
    (llama-imatrix's GGUF: ``general.type`` = ``imatrix``); returns it and its manifest entry."""
    from service.exporters.gguf.directory import read_directory
    from service.sources import fetch_source

    work_dir = ctx.work_dir / "imatrix-source"
    work_dir.mkdir(parents=True, exist_ok=True)
    # its own scratch directory; the job's phase, progress and source details describe the model
    side = SideContext(ctx, work_dir, metric_prefix="imatrix_")
    resolved = fetch_source(spec.source_request(), ctx.settings, side)
    path = resolved.path
    if path.is_dir():
        found = sorted(p for p in path.iterdir() if p.suffix == ".gguf")
        if len(found) != 1:
            raise ImatrixNotValid(f"{spec.uri} holds {len(found)} .gguf files, not one imatrix")
        path = found[0]
    try:
        kind = read_directory(path).metadata.get("general.type")
    except (OSError, ValueError, VerificationFailed) as exc:
        raise ImatrixNotValid(f"{spec.uri} is not a GGUF file: {exc}") from None
    if kind != "imatrix":
        raise ImatrixNotValid(
            f"{spec.uri} is a GGUF of general.type {kind!r}, not an importance matrix "
            "(llama-imatrix writes general.type = imatrix)"
        )
    entry: dict[str, Any] = {
        "uri": side.details.get("source", {}).get("uri", spec.uri),
        "sha256": sha256_of(path),
        "bytes": path.stat().st_size,
        "cache_hit": resolved.cache_hit,
    }
    return path, entry


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def quantize(
    source: Path,
    dest: Path,
    type_name: str,
    work: Path,
    check_abort: Callable[[], None],
    advance: Callable[[int], None],
    progress_units: int,
    imatrix: Path | None = None,
    bin_dir: Path | None = None,
    buffer_bytes: int = QUANTIZER_BUFFER,
) -> QuantizeRun:
    """Quantize ``source`` (f16/bf16/f32 GGUF) into ``dest`` with llama-quantize's mixture,
    each tensor in row blocks of at most ``buffer_bytes`` (whole MiB, at least one).

    ``progress_units`` are reported through ``advance`` as the tool moves through the tensors.
    On any failure ``dest`` is removed: no partial artifact survives."""
    tool = llama_cpp_tool("llama-quantize", bin_dir)
    argv = [str(tool), *buffer_argv(buffer_bytes)]
    if imatrix is not None:
        argv += ["--imatrix", str(imatrix)]
    argv += [str(source), str(dest), QUANTIZER_TYPES[type_name.lower()], str(_threads())]
    progress = _LogProgress(work / "quantize.log", progress_units, advance)
    try:
        peaks = run_child(
            argv, work, "llama-quantize", check_abort, TOOL_ENV,
            log=progress.log, on_poll=progress.poll, timeout=TOOL_TIMEOUT, error=ExportFailed,
        )  # fmt: skip
        if not dest.is_file():
            raise ExportFailed(f"llama-quantize exited without writing {dest.name}")
        progress.finish()
        return QuantizeRun(digest=sha256_file(dest), peaks=peaks)
    except BaseException:
        dest.unlink(missing_ok=True)
        raise


def buffer_argv(buffer_bytes: int) -> list[str]:
    """llama-quantize's option bounding the rows of a tensor it holds at once: whole MiB, at
    least one (the tool refuses less)."""
    return ["--max-buffer-size", str(max(1, buffer_bytes >> 20))]


def split_gguf(
    source: Path,
    dest: Path,
    max_bytes: int,
    work: Path,
    check_abort: Callable[[], None],
    bin_dir: Path | None = None,
) -> dict[str, str]:
    """``source`` as llama.cpp's split files named after ``dest`` (``<stem>-00001-of-0000N.gguf``
    beside it), by ``llama-gguf-split --split``; returns {file name: sha256}, first to last.

    llama-gguf-split counts in megabytes (10^6 bytes): ``max_bytes`` is rounded down to one,
    at least 1M. On any failure no split file is left."""
    tool = llama_cpp_tool("llama-gguf-split", bin_dir)
    prefix = dest.with_suffix("")
    size = f"{max(1, max_bytes // 10**6)}M"
    argv = [str(tool), "--split", "--split-max-size", size, str(source), str(prefix)]

    def written() -> list[Path]:
        return sorted(dest.parent.glob(f"{glob.escape(prefix.name)}-*-of-*.gguf"))

    try:
        run_child(
            argv, work, "llama-gguf-split", check_abort, TOOL_ENV,
            log=work / "split.log", timeout=TOOL_TIMEOUT, error=ExportFailed,
        )  # fmt: skip
        files = written()
        if not files:
            raise ExportFailed("llama-gguf-split wrote no split file")
        return {f.name: sha256_file(f) for f in files}
    except BaseException:
        for f in written():
            f.unlink(missing_ok=True)
        raise


def _threads() -> int:
    """The cores this process may use: llama.cpp's tools default to all, which is the same."""
    return max(1, len(os.sched_getaffinity(0)))
