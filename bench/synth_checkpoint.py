"""Write a synthetic Llama-shaped safetensors checkpoint of any size without holding it in RAM.

Tensor names and shapes come from a real ``LlamaForCausalLM`` built on the ``meta`` device, so
the result loads like a hub checkpoint; values are seeded random normals (std 0.02; norms around
1, as trained; the head a scaled copy of the embedding, so each next token is decided by a
margin) generated one chunk at a time. The writing itself is the project's streaming safetensors exporter fed by a synthetic
reader, so shards (~1 GB) and the index follow the Hugging Face layout.

    .venv/bin/python bench/synth_checkpoint.py var/bench/llama-7l --layers 7

The largest tensor is the embedding (``vocab_size x hidden_size``), fixed whatever ``--layers``
is: that is how two model sizes with the same largest tensor are made.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.checkpoint.base import FileRegion, TensorInfo
from service.config import Settings
from service.exporters.safetensors.writer import (
    INDEX_FILE,
    plan_shards,
    write_shard,
)
from service.fsutil import atomic_write_json
from service.stage import InMemoryContext


def llama_config(layers: int, hidden: int, intermediate: int, vocab: int) -> dict[str, object]:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    config.architectures = ["LlamaForCausalLM"]
    out: dict[str, object] = config.to_dict()
    out["dtype"] = "float32"
    return out


def tensor_shapes(config: dict[str, object]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor ``save_pretrained`` would write, in module order."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_dict(config))
    return [(n, tuple(t.shape)) for n, t in model.state_dict().items()]


class SyntheticReader:
    """A :class:`WeightReader` whose tensors are seeded random float32 made on demand."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]], seed: int = 0) -> None:
        self._infos = [
            TensorInfo(name=n, dtype=torch.float32, shape=s, file=Path("synthetic"))
            for n, s in shapes
        ]
        self._index = {info.name: i for i, info in enumerate(self._infos)}
        self.seed = seed

    def tensor_infos(self) -> list[TensorInfo]:
        return list(self._infos)

    def aliases(self) -> dict[str, str]:
        return {}

    def add_alias(self, alias: str, canonical: str) -> None:
        raise TypeError("a synthetic checkpoint has no tied names to serve")

    def read(self, name: str) -> torch.Tensor:
        info = self._infos[self._index[name]]
        return torch.cat(list(self.iter_chunks(name, 64 << 20))).reshape(info.shape)

    def iter_chunks(self, name: str, max_bytes: int) -> Iterator[torch.Tensor]:
        info = self._infos[self._index[name]]
        # The head is the embedding scaled (one seed, untied names): at std 4 a token's own
        # embedding dominates the residual stream, and at the head's std 0.008 it leads the
        # next-token logits by ~0.008 x hidden (12 at hidden 1536) over the others' std 0.3,
        # as a trained model's clear choices do. With every tensor at std 0.02 the logits were
        # near ties, where a quantized export's top-1 agreement with the reference is a coin
        # toss (a correct Q4_K_M agreed on 0.40): the job's logit check could not tell right
        # from wrong.
        vocab = name in ("model.embed_tokens.weight", "lm_head.weight")
        seeded = "model.embed_tokens.weight" if vocab else name
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self._index[seeded])
        step = max(1, max_bytes // 4)
        # norms near 1 as in a trained model
        offset = 1.0 if name.endswith("norm.weight") else 0.0
        std = {"model.embed_tokens.weight": 4.0, "lm_head.weight": 0.008}.get(name, 0.02)
        for start in range(0, info.numel, step):
            yield torch.randn(min(step, info.numel - start), generator=gen) * std + offset

    def region(self, name: str) -> FileRegion | None:
        return None

    def close(self) -> None:
        pass


def write_checkpoint(
    out_dir: Path,
    layers: int = 7,
    hidden: int = 4096,
    intermediate: int = 11008,
    vocab: int = 32000,
    shard_size: int = 10**9,
    seed: int = 0,
) -> dict[str, object]:
    """Write config.json, shards and index under ``out_dir``; returns a summary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = llama_config(layers, hidden, intermediate, vocab)
    reader = SyntheticReader(tensor_shapes(config), seed)
    plan = plan_shards(reader, None, shard_size, tied_targets=set())
    ctx = InMemoryContext(settings=Settings(data_dir=out_dir / ".var"), work_dir=out_dir)
    for shard in plan.shards:
        write_shard(reader, shard, out_dir, ctx)
    if len(plan.shards) > 1:
        index = {"metadata": {"total_size": plan.total_size}, "weight_map": plan.weight_map}
        atomic_write_json(out_dir / INDEX_FILE, index)
    atomic_write_json(out_dir / "config.json", config)
    largest = max(i.nbytes for i in reader.tensor_infos())
    return {
        "dir": str(out_dir),
        "layers": layers,
        "total_bytes": plan.total_size,
        "shards": len(plan.shards),
        "largest_tensor_bytes": largest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--layers", type=int, default=7, help="7 layers = 6.7 GB float32")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard-size", type=int, default=10**9)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.monotonic()
    summary = write_checkpoint(
        args.out_dir,
        args.layers,
        args.hidden,
        args.intermediate,
        args.vocab,
        args.shard_size,
        args.seed,
    )
    summary["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
