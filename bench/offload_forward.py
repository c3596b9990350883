"""Benchmark: forward pass of a model larger than its RAM budget, ours vs accelerate.

Writes a float32 Llama-shaped checkpoint (7B-like widths, sharded safetensors, never held in
RAM: headers first, then data streamed from one small random block), then, for each layer
count, runs in a fresh child process:

* ``ours``: ``build_on_meta`` -> ``dispatch_model(max_memory=1GiB)`` (in-place references, no
  copy) -> ``streamed_forward``;
* ``accelerate``: ``init_empty_weights`` -> ``load_checkpoint_and_dispatch(device_map="auto",
  max_memory={"cpu": 1GiB}, offload_folder=...)`` -> forward;

and prints peak RSS (``ru_maxrss`` of the child) and wall times. Files go under
``--work`` (default ``var/bench``, gitignored) and are deleted afterwards.

    .venv/bin/python bench/offload_forward.py --layers 4 8
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 4096, 11008, 32, 8, 32000
SHARD_BYTES = 2 * 10**9
BUDGET = "1GiB"
SEQ = 8


def tensor_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint in storage order, as ``save_pretrained`` orders them."""
    kv = HIDDEN // HEADS * KV_HEADS
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.v_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
        ]
    shapes += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return shapes


def write_checkpoint(out: Path, layers: int) -> int:
    """A sharded float32 safetensors checkpoint written with O(16 MiB) of RAM; returns bytes."""
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(4 << 20) * 0.02).astype("<f4").tobytes()  # 16 MiB
    ones = np.ones(4 << 20, dtype="<f4").tobytes()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensor_shapes(layers):
        nbytes = 4 * _numel(shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in shard:
            nbytes = 4 * _numel(shape)
            header[name] = {
                "dtype": "F32",
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[name] = fname
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with (out / fname).open("wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name, shape in shard:
                left = 4 * _numel(shape)
                source = ones if name.endswith("norm.weight") else block
                while left:
                    piece = source[: min(left, len(source))]
                    f.write(piece)
                    left -= len(piece)
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config))
    return total


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _input_ids() -> Any:
    import torch

    return torch.arange(1, SEQ + 1).reshape(1, SEQ) * 97 % VOCAB


def child_ours(ckpt: Path, work: Path) -> dict[str, Any]:
    # import time is not build time: load what build_on_meta imports lazily first
    import accelerate  # noqa: F401
    import torch
    from transformers import AutoConfig, LlamaForCausalLM  # noqa: F401

    from service.checkpoint import open_checkpoint
    from service.config import Settings
    from service.offload.build import build_on_meta
    from service.offload.dispatch import dispatch_model
    from service.offload.store import OffloadStore
    from service.offload.streaming import streamed_forward
    from service.stage import InMemoryContext

    t0 = time.perf_counter()
    settings = Settings(data_dir=work / "var")
    ctx = InMemoryContext(settings=settings, work_dir=work)
    with open_checkpoint(ckpt) as checkpoint:
        built = build_on_meta(checkpoint, settings, dtype=torch.float32)
        t_build = time.perf_counter() - t0
        store = OffloadStore(work / "offload", allowed_roots=[ckpt])
        result = dispatch_model(built, checkpoint.reader, store, ctx, max_memory=BUDGET)
        t_dispatch = time.perf_counter() - t0 - t_build
        t1 = time.perf_counter()
        ids = _input_ids()
        logits, stats = streamed_forward(built.model, {"input_ids": ids})
        t_forward = time.perf_counter() - t1
    metrics = store.metrics()
    store.destroy()
    return {
        "build_s": round(t_build, 3),
        "dispatch_s": round(t_dispatch, 3),
        "forward_s": round(t_forward, 3),
        "placed": result.placed,
        "offload_bytes_written": metrics["bytes_written"],
        "bytes_read": metrics["bytes_read"],
        "peak_paged_mib": round(stats.peak_resident_bytes / 2**20, 1),
        "logits_checksum": float(logits.double().abs().sum()),
    }


def child_accelerate(ckpt: Path, work: Path) -> dict[str, Any]:
    import torch
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, LlamaForCausalLM

    from service.offload.device_map import auto_device_map

    t0 = time.perf_counter()
    config = AutoConfig.from_pretrained(str(ckpt), local_files_only=True)
    with init_empty_weights():
        model = LlamaForCausalLM._from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    t_build = time.perf_counter() - t0
    # accelerate's own "auto" plan for this budget puts every module on disk, which its
    # loader then rejects ("device disk is invalid"); give it the map our planner makes for
    # the same budget (embeddings in RAM, the rest on disk).
    device_map = auto_device_map(model, BUDGET, ["LlamaDecoderLayer"], torch.float32)
    model = load_checkpoint_and_dispatch(
        model,
        checkpoint=str(ckpt),
        device_map=dict(device_map),
        offload_folder=str(work / "offload"),
        dtype=torch.float32,
    )
    t_dispatch = time.perf_counter() - t0 - t_build
    t1 = time.perf_counter()
    with torch.inference_mode():
        logits = model(input_ids=_input_ids(), use_cache=False).logits
    t_forward = time.perf_counter() - t1
    offload_bytes = sum(p.stat().st_size for p in (work / "offload").rglob("*") if p.is_file())
    return {
        "build_s": round(t_build, 3),
        "dispatch_s": round(t_dispatch, 3),
        "forward_s": round(t_forward, 3),
        "offload_bytes_written": offload_bytes,
        "logits_checksum": float(logits.double().abs().sum()),
    }


def child_skeleton_70b(ckpt: Path, work: Path) -> dict[str, Any]:
    """Time to build a 70B Llama on meta once imports are done, and what it costs in RAM."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from service.config import Settings
    from service.offload.build import build_meta_model

    config = LlamaConfig(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        model = build_meta_model(config, Settings(), torch.bfloat16, LlamaForCausalLM)
        times.append(round(time.perf_counter() - t0, 3))
    return {
        "build_s": times,
        "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
        "rss_growth_mib": round(
            (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024, 1
        ),
    }


def run_child(kind: str, ckpt: Path, work: Path) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, "--ckpt", str(ckpt), "--work", str(work)],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    wall = time.perf_counter() - started
    shutil.rmtree(work, ignore_errors=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:], "wall_s": round(wall, 2)}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = round(wall, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--work", type=Path, default=REPO / "var" / "bench-offload")
    parser.add_argument("--child", choices=["ours", "accelerate", "skeleton70b"])
    parser.add_argument("--ckpt", type=Path)
    parser.add_argument("--skip-accelerate", action="store_true")
    args = parser.parse_args()

    if args.child:
        runners = {
            "ours": child_ours,
            "accelerate": child_accelerate,
            "skeleton70b": child_skeleton_70b,
        }
        result = runners[args.child](args.ckpt, args.work)
        result["peak_rss_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
        print(json.dumps(result))
        return

    skeleton = run_child("skeleton70b", Path("-"), args.work / "run-skeleton")
    print("# 70B Llama skeleton on meta:", json.dumps(skeleton), flush=True)
    rows = []
    for layers in args.layers:
        ckpt = args.work / f"llama-{layers}l"
        shutil.rmtree(ckpt, ignore_errors=True)
        t0 = time.perf_counter()
        total = write_checkpoint(ckpt, layers)
        gen_s = time.perf_counter() - t0
        try:
            kinds = ["ours"] if args.skip_accelerate else ["ours", "accelerate"]
            for kind in kinds:
                result = run_child(kind, ckpt, args.work / f"run-{kind}")
                row: dict[str, Any] = {
                    "layers": layers,
                    "checkpoint_gb": round(total / 1e9, 2),
                    "impl": kind,
                }
                row.update(result)
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)
        print(f"# generated {total / 1e9:.2f} GB in {gen_s:.1f}s", flush=True)
    print(
        "\nlayers  ckpt_GB  impl        peak_RSS_MiB  dispatch_s  forward_s  wall_s  offload_written"
    )
    for r in rows:
        print(
            f"{r['layers']:>6}  {r['checkpoint_gb']:>7}  {r['impl']:<10}  "
            f"{r.get('peak_rss_mib', '-'):>12}  {r.get('dispatch_s', '-'):>10}  "
            f"{r.get('forward_s', '-'):>9}  {r['wall_s']:>6}  {r.get('offload_bytes_written', '-')}"
            + (f"  ERROR {r['error']}" if "error" in r else "")
        )


if __name__ == "__main__":
    main()
