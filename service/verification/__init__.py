"""How an artifact is judged: every check runs the artifact in its real consumer and compares
what comes out with a reference computed from the source.

The modules:

- ``reference``: the inputs every check feeds (:func:`~reference.fixed_input_ids`, the one
  batch the source's reference outputs are computed on; :func:`~reference.prompt_ids`, the
  prompt a graph export is traced and run with) and PyTorch's greedy decode of that prompt
  (:func:`~reference.greedy_reference`), which tract and onnxruntime replay.
- ``independent``: the source as transformers' own ``from_pretrained`` reads it (whole, layer
  by layer or module by module from disk), computed once per job in float32: its outputs on
  the fixed input ids and its logits on the chunks of the fixed text. An implementation that
  is not ours, so a misreading of the source shared by our reader and the artifact cannot pass.
- ``mapped``: the stand-ins ``independent`` puts where a vocabulary matrix or a projection
  larger than its block would be loaded, read from the published file a block of rows at a time.
- ``parity``: output comparison: the tolerance table by runner and dtype
  (:data:`~parity.TOLERANCES`, ``atol + rtol * max|reference|``), the largest error over every
  compared output (:func:`~parity.compare_outputs`, :func:`~parity.relative_agreement`), one
  report (:class:`~parity.ParityReport`).
- ``logits``: the fixed text (:data:`~logits.FIXED_TEXT`) and the figures of an artifact's
  next-token distributions against the reference's, as ``llama-perplexity --kl-divergence``
  defines them (KL mean and p99, top-1 agreement, perplexity ratio), and the bounds graph
  runtimes are held to.
- ``quality``: a lossy artifact's quality report read with the reference's own margins (near
  ties by the type's noise, top-1 on decided positions) and what fails a job on quality: the
  request's thresholds (``thresholds``, pydantic only, for the specs) or the margin-aware
  default.
- ``llama_kl``: llama.cpp's KL file format: the reference's logits written as
  ``llama-perplexity``'s base file, and the figures it prints read back.
- ``weight_error``: a quantized file's stored weights against the source's (relative RMS
  error, streamed in the pieces the check holds, :data:`~weight_error.WEIGHT_ERROR_BOUND`): what
  an exact check on the file's own weights cannot see.

What each consumer check compares, against what:

- **the job's own reading** (``jobs.pipeline``): the offloaded model's outputs on the fixed
  input ids against ``independent``'s (``parity.relative_agreement``); the job fails before any
  artifact is judged when they differ.
- **safetensors** (``exporters.safetensors.verify``): the written files, reloaded and run by
  transformers (streamed, float32), on the fixed input ids, against the source's outputs on
  the same ids; ``parity`` with the ``torch`` tolerances of the export dtype.
- **GGUF** (``exporters.gguf``): the file read back against the source's tensors; llama.cpp's
  ``llama-tokenize`` against the Hugging Face tokenizer's ids; ``llama-perplexity
  --kl-divergence`` against ``independent``'s logits on the fixed text (written by
  ``llama_kl``): the ``quality`` report (the ``logits`` figures, the reference's margins, top-1
  on decided positions), judged by the request's thresholds and the margin-aware default; a
  VLM's projector by
  ``llama-mtmd-cli``'s greedy tokens against transformers' on a fixed image.
- **NNEF** (``exporters.nnef.verify``): tract's prompt and greedy decode steps against
  PyTorch's (``reference.greedy_reference``), ``parity`` with the ``runtime`` tolerances; then
  tract's logits on the fixed text against ``independent``'s, the ``logits`` figures within
  the runtime bounds; a compressed (q4_0) archive is instead held exactly to PyTorch's run of
  its own weights (``exporters.nnef.exact``, float32's tolerance), its quality figures
  reported and judged only by the request's thresholds.
- **ONNX** (``exporters.onnx.verify``): onnxruntime's prompt and decode steps against
  PyTorch's greedy decode with its KV cache, ``parity`` with the ``runtime`` tolerances and the
  same argmax at every step; then onnxruntime's logits on the fixed text against
  ``independent``'s, the ``logits`` figures within the runtime bounds. int4/int8: PyTorch runs
  on the file's own weights dequantized (``exporters.onnx.artifact_weights``), each held to the
  source's (``weight_error``), the logits figures reported as quality, not judged.

It sits between ``service.plan`` and ``service.checkpoint`` in the layers: the exporters and
the pipeline import it; it imports only the checkpoint readers and the leaves.
"""
