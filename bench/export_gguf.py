"""Benchmark: GGUF export of a >= 4 GB float32 Llama-shaped checkpoint, streamed vs held in RAM.

    .venv/bin/python bench/export_gguf.py [--layers 22] [--types f16,q8_0] [--dir /tmp/...]

Writes a synthetic TinyLlama-1.1B-shaped ``model.safetensors`` (float32, ~4.4 GB) without
holding it in memory, then runs each measurement in its own child process and prints peak RSS
and wall time:

* ``streamed``: the exporter's path (``write_gguf``), then its read-back ``verify_gguf``;
* ``gguf-writer``: llama.cpp's convert style, every converted tensor handed to
  ``gguf.GGUFWriter.add_tensor`` and written by ``write_tensors_to_file`` (holds them all).

Both produce the same bytes (same layout and metadata): the script checks the sha256s match.
Big files go to ``--dir`` (default under /tmp) and are deleted at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 2048, 5632, 32, 4, 32000


def llama_config(layers: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def tensor_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    kv = HIDDEN // HEADS * KV_HEADS
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.v_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return shapes


def write_synthetic_checkpoint(out: Path, layers: int) -> int:
    """A float32 safetensors file written tensor by tensor in 64 MiB pieces; returns its size."""
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(llama_config(layers), indent=2))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    shapes = tensor_shapes(layers)
    for name, shape in shapes:
        n = 4
        for d in shape:
            n *= d
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(0)
    piece = 16 * 1024 * 1024  # elements
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape in shapes:
            count = 1
            for d in shape:
                count *= d
            norm = name.endswith("norm.weight")
            for start in range(0, count, piece):
                size = min(piece, count - start)
                data = rng.standard_normal(size, dtype=np.float32) * np.float32(0.02)
                if norm:
                    data += np.float32(1.0)
                f.write(data.tobytes())
    return (out / "model.safetensors").stat().st_size


# --- children ----------------------------------------------------------------------------------


class _Progress:
    def advance(self, n: int) -> None:
        pass

    def check_abort(self) -> None:
        pass


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_streamed(ckpt: Path, out: Path, type_: str) -> dict[str, Any]:
    from service.checkpoint import open_checkpoint
    from service.exporters.gguf_plan import add_hyperparameters, plan_tensors
    from service.exporters.gguf_stream import verify_gguf, write_gguf

    with open_checkpoint(ckpt) as c:
        assert c.config is not None
        config = c.config
        plan = plan_tensors(config, c.reader.tensor_infos(), c.reader.aliases(), type_)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        digest = write_gguf(
            out,
            plan,
            c.reader,
            lambda w: add_hyperparameters(w, plan, config, "synth"),
            _Progress(),
        )
        write_s = time.perf_counter() - t0
        write_rss = _peak_rss()
        t1 = time.perf_counter()
        report = verify_gguf(out, plan, c.reader, _Progress())
        verify_s = time.perf_counter() - t1
    return {
        "sha256": digest,
        "write_s": write_s,
        "write_peak_rss": write_rss,
        "verify_s": verify_s,
        "peak_rss": _peak_rss(),
        "max_abs_error": report.max_abs_error,
        "bytes": out.stat().st_size,
    }


def child_gguf_writer(ckpt: Path, out: Path, type_: str) -> dict[str, Any]:
    import gguf
    import numpy as np

    from service.checkpoint import open_checkpoint
    from service.exporters.gguf_plan import add_hyperparameters, plan_tensors
    from service.exporters.gguf_stream import encode, source_blocks

    t0 = time.perf_counter()
    with open_checkpoint(ckpt) as c:
        assert c.config is not None
        plan = plan_tensors(c.config, c.reader.tensor_infos(), c.reader.aliases(), type_)  # type: ignore[arg-type]
        writer = gguf.GGUFWriter(out, plan.arch_name)
        add_hyperparameters(writer, plan, c.config, "synth")
        for t in plan.tensors:
            rows = np.concatenate(list(source_blocks(c.reader, t, 64 * 1024**2)))
            data = encode(rows, t.ggml_type)
            del rows
            shape = t.shape if data.dtype != np.uint8 else data.reshape(*t.shape[:-1], -1).shape
            writer.add_tensor(
                t.name, data.reshape(shape), raw_dtype=gguf.GGMLQuantizationType(t.ggml_type)
            )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    write_s = time.perf_counter() - t0
    h = hashlib.sha256()
    with open(out, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return {"sha256": h.hexdigest(), "write_s": write_s, "peak_rss": _peak_rss()}


def run_child(mode: str, ckpt: Path, out: Path, type_: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(ckpt), str(out), type_],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{mode} {type_} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - t0
    out.unlink(missing_ok=True)
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, ckpt, out, type_ = sys.argv[2:6]
        fn = child_streamed if mode == "streamed" else child_gguf_writer
        print(json.dumps(fn(Path(ckpt), Path(out), type_)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--types", default="f16,q8_0")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--no-baseline", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="modelprep-gguf-bench-", dir=args.dir))
    gib = 1024**3
    try:
        t0 = time.perf_counter()
        size = write_synthetic_checkpoint(work / "ckpt", args.layers)
        print(
            f"checkpoint: {size / gib:.2f} GiB float32 ({args.layers} layers) "
            f"written in {time.perf_counter() - t0:.0f} s"
        )
        for type_ in args.types.split(","):
            ours = run_child("streamed", work / "ckpt", work / f"out-{type_}.gguf", type_)
            print(
                f"{type_:5s} streamed    : write {ours['write_s']:6.1f} s, peak RSS "
                f"{ours['write_peak_rss'] / gib:.2f} GiB; + verify {ours['verify_s']:6.1f} s, "
                f"peak RSS {ours['peak_rss'] / gib:.2f} GiB; file {ours['bytes'] / gib:.2f} GiB; "
                f"max abs error {ours['max_abs_error']}"
            )
            if args.no_baseline:
                continue
            base = run_child("gguf-writer", work / "ckpt", work / f"base-{type_}.gguf", type_)
            same = "identical bytes" if base["sha256"] == ours["sha256"] else "DIFFERENT BYTES"
            print(
                f"{type_:5s} gguf-writer : write {base['write_s']:6.1f} s, peak RSS "
                f"{base['peak_rss'] / gib:.2f} GiB ({same})"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
