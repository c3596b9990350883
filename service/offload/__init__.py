"""Bounded-memory model handling: build on meta, dispatch weights to disk, stream forward.

Modules (imported directly; this package stays import-light so the API process can use
:mod:`service.offload.usage` without loading torch):

* :mod:`.build`      ``build_on_meta(checkpoint, settings, dtype) -> BuiltModel``, ``build_phase``
* :mod:`.device_map` ``resolve_device_map(model, "auto" | {...}, max_memory, no_split, dtype)``
* :mod:`.paths`      where a job's store lives and its file names (no torch: the API uses it)
* :mod:`.store`      ``OffloadStore`` (the on-disk format), ``open_job_store(settings, job_id, root)``
* :mod:`.tensor`     ``StoreTensor``: a tensor read back from the store on each use
* :mod:`.quant`      GGML q8_0 / q4_0 packing of offloaded weights
* :mod:`.dispatch`   ``dispatch_model(built, reader, store, ctx, max_memory=...)``
* :mod:`.streaming`  ``streamed_forward(model, inputs)``: weights paged in module by module
* :mod:`.usage`      ``offload_usage(settings)``: per-job and total figures for GET /v1/offload
"""
