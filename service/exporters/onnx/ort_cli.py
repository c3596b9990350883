"""Run an exported ONNX model in onnxruntime, as a child process of the job.

onnxruntime memory-maps the external initializers (their offsets are aligned and no node
copies a weight: :mod:`service.exporters.onnx.mapped`), so the weights cost page cache, which
the kernel reclaims under a memory limit, not the runtime's memory. A child process all the
same (its memory returned when it exits, a crash failing the verification, not the job), run by
:mod:`service.exporters.onnx.verify`
(``python -P ort_cli.py``: it imports nothing of the service, and ``-P`` keeps this package
directory, whose ``onnx.py`` would shadow the ``onnx`` package, off ``sys.path``)::

    ort_cli.py MODEL.onnx run    REQUEST.npz OUTPUTS.npz   # one run, feeds named as the inputs
    ort_cli.py MODEL.onnx decode REQUEST.npz OUTPUTS.npz   # greedy decode with the KV cache
    ort_cli.py MODEL.onnx generate REQUEST.npz OUTPUTS.npz # onnxruntime-genai's generator

``generate`` loads the model's directory with ``onnxruntime_genai.Model`` (its
``genai_config.json``) and decodes ``prompt`` [1,S] greedily for ``steps`` tokens with
``onnxruntime_genai.Generator``, saving them as ``tokens`` (fewer if it stopped at an end of
sequence token).

``decode`` requests hold ``prompt`` [1,S] and ``tokens`` [n]: the prompt runs with empty
``past_key_values.*`` inputs, then each given token is fed with onnxruntime's own ``present.*``
outputs as the next past (teacher forcing: one near-tie argmax cannot derail the comparison).
The last position's logits of every step are saved as ``logits`` [n, vocab]. ``run`` saves the
outputs under their graph names. Each saves the seconds onnxruntime took to load the model
(``load_seconds``: the session, its graph optimizations, the weights mapped) and to run the
request (``run_seconds``), and this process's peak RSS as ``peak_rss_bytes``, read
from ``VmHWM`` here: the ``ru_maxrss`` the parent gets from ``wait4`` also counts the parent's
pages the child had before ``exec`` (Linux keeps the pre-exec high-water mark).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


def open_session(model: Path) -> Any:
    """A CPU session; one intra-op thread pool sized by onnxruntime, no graph dump."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


def run_decode(session: Any, request: dict[str, np.ndarray]) -> np.ndarray:
    """Teacher-forced greedy decode; the last position's logits at every step."""
    inputs = {i.name: i for i in session.get_inputs()}
    past_names = [n for n in inputs if n.startswith("past_key_values.")]
    present_names = [o.name for o in session.get_outputs() if o.name.startswith("present.")]
    prompt = np.ascontiguousarray(request["prompt"], dtype=np.int64)
    feeds: dict[str, np.ndarray] = {}
    for name in past_names:
        shape = inputs[name].shape  # [batch, kv_heads, past, head_dim]
        dims = [1, int(shape[1]), 0, int(shape[3])]
        feeds[name] = np.zeros(dims, dtype=_ORT_DTYPES.get(inputs[name].type, np.float32))
    step_ids = prompt
    seen = 0
    found = []
    for token in request["tokens"]:
        count = step_ids.shape[1]
        feeds["input_ids"] = step_ids
        if "attention_mask" in inputs:
            feeds["attention_mask"] = np.ones((1, seen + count), dtype=np.int64)
        if "position_ids" in inputs:
            feeds["position_ids"] = np.arange(seen, seen + count, dtype=np.int64)[None]
        outputs = session.run(["logits", *present_names], feeds)
        found.append(np.asarray(outputs[0], dtype=np.float32)[0, -1])
        for past, present in zip(past_names, outputs[1:], strict=True):
            feeds[past] = present
        seen += count
        step_ids = np.asarray([[int(token)]], dtype=np.int64)
    return np.stack(found)


class AnonymousPeak:
    """The most resident anonymous memory (``RssAnon``) this process held, sampled every few
    milliseconds by a daemon thread: with its weights memory-mapped, onnxruntime's ``VmHWM``
    counts mapped pages of the data file (page cache, which the kernel reclaims under a limit);
    this counts what the runtime itself allocated."""

    def __init__(self, every: float = 0.005) -> None:
        import threading

        self.peak = 0
        self._every = every
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        import time

        while True:
            with open("/proc/self/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith("RssAnon:"):
                        self.peak = max(self.peak, int(line.split()[1]) * 1024)
            time.sleep(self._every)


def run_chunks(session: Any, request: dict[str, np.ndarray]) -> np.ndarray:
    """Each chunk of ``request["chunks"]`` run from an empty cache; the logits of positions
    ``[first, last)`` of each, ``(n_chunk, last - first, vocab)``."""
    inputs = {i.name: i for i in session.get_inputs()}
    first, last = int(request["first"]), int(request["last"])
    found = []
    for chunk in np.asarray(request["chunks"], dtype=np.int64):
        feeds: dict[str, np.ndarray] = {
            name: np.zeros((1, int(i.shape[1]), 0, int(i.shape[3])),
                           dtype=_ORT_DTYPES.get(i.type, np.float32))
            for name, i in inputs.items() if name.startswith("past_key_values.")
        }  # fmt: skip
        feeds["input_ids"] = np.ascontiguousarray(chunk[None])
        if "attention_mask" in inputs:
            feeds["attention_mask"] = np.ones((1, len(chunk)), dtype=np.int64)
        if "position_ids" in inputs:
            feeds["position_ids"] = np.arange(len(chunk), dtype=np.int64)[None]
        (logits,) = session.run(["logits"], feeds)
        found.append(np.asarray(logits, dtype=np.float32)[0, first:last])
    return np.stack(found)


def run_generate(model: Path, request: dict[str, np.ndarray]) -> np.ndarray:
    """onnxruntime-genai's greedy generator from the package directory; the tokens it chose."""
    import onnxruntime_genai as og

    genai_model = og.Model(str(model.parent))
    prompt = [int(t) for t in np.asarray(request["prompt"]).reshape(-1)]
    steps = int(request["steps"])
    params = og.GeneratorParams(genai_model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + steps, num_beams=1)
    generator = og.Generator(genai_model, params)
    generator.append_tokens(prompt)
    tokens: list[int] = []
    while not generator.is_done() and len(tokens) < steps:
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return np.asarray(tokens, dtype=np.int64)


def peak_rss_bytes() -> int:
    """This process's resident high-water mark since ``exec`` (``VmHWM``)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0  # pragma: no cover - every Linux kernel since 2.6 reports VmHWM


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: exit status 2 and one line on stderr for a wrong invocation."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 4 or args[1] not in ("run", "decode", "logits", "generate"):
        print(
            "usage: ort_cli.py MODEL.onnx run|decode|logits|generate REQUEST.npz OUTPUTS.npz",
            file=sys.stderr,
        )
        return 2
    model, command, request_path, outputs_path = Path(args[0]), args[1], args[2], args[3]
    anonymous = AnonymousPeak()
    started = time.monotonic()
    session: Any = open_session(model) if command != "generate" else None
    loaded = time.monotonic()
    with np.load(request_path) as bundle:
        request = {k: bundle[k] for k in bundle.files}
    named: dict[str, Any]
    if command == "generate":
        named = {"tokens": run_generate(model, request)}
    elif command == "logits":
        named = {"logits": run_chunks(session, request)}
    elif command == "decode":
        named = {"logits": run_decode(session, request)}
    else:
        names = [o.name for o in session.get_outputs()]
        named = dict(zip(names, session.run(names, request), strict=True))
    named["peak_rss_bytes"] = np.int64(peak_rss_bytes())
    named["peak_anon_bytes"] = np.int64(anonymous.peak)
    named["load_seconds"] = np.float64(loaded - started)
    named["run_seconds"] = np.float64(time.monotonic() - loaded)
    np.savez(outputs_path, **named)
    return 0


if __name__ == "__main__":  # pragma: no cover - run as a child process
    sys.exit(main())
