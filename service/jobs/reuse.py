"""Result reuse: a job whose source and recipe match a succeeded job shares its artifacts.

**The key.** ``reuse_key`` is the sha256 of a canonical JSON of

- the source's *resolved identity* (:class:`service.sources.SourceIdentity`): hub repo at the
  resolved commit (and the hub endpoint), the sha256 of an HTTP file, or a content hash of a
  local checkpoint's files; never the URI as written, so a branch name that moved, two URLs of
  one file or two copies of one directory resolve to what they really are;
- the *recipe*: the exports list as validated (every field, defaults included, in order, so
  ``{"format": "gguf"}`` and the same export with its default spelled out are one recipe) and
  ``verify`` (it changes the manifest and what was checked). ``max_memory``, ``timeout``,
  ``reuse``, tokens and callbacks do not change the bytes and are not part of it;
- the *tenant* that submits the job: reuse never crosses tenants. A declared sha256 settles
  before any request, so across tenants it would hand one tenant's artifacts to another that
  merely knows (or guesses from a public listing) the hash of a file it may not fetch;
- the *producers*: the versions of modelprep and of the libraries and tools that write or check
  artifacts (torch, transformers, gguf, llama.cpp, torch-to-nnef, onnx...), so an upgrade that
  changes the bytes does not hand out artifacts an older one made.

**The order** (:func:`service.jobs.pipeline.run_pipeline`): the identity is resolved as early as
it can be, then the job settles, then it downloads only if it computes. Known before any
download: a hub revision (one API call resolves a branch or tag to its commit, and the download
is then pinned to it), a declared sha256, a local checkpoint (hashed in place, digests cached
by inode). Known only after the download: an HTTP file without a sha256 (hashed once fetched;
two such jobs at once both download, then one computes).

**Settling** (:func:`service.jobs.store.reuse.settle_reuse`) is one transaction under a lock
on the key, in the job store: so it holds across the local pool, other API processes and
distributed workers on PostgreSQL alike. A job finds a succeeded job with the key whose files
are still there (reuse), or a running one (wait, then settle again), or neither (compute, and
record the key, so later and concurrent identical jobs find it).

**Sharing** is by hard links: the reusing job's ``artifacts/`` holds links to the same inodes,
published with the same rename as computed artifacts. The filesystem keeps the count: DELETE or
retention of either job removes its own directory and the bytes stay while any job links them,
with no reference table to keep consistent across processes, hosts or crashes; every existing
path (artifact URLs, DELETE, TTL, the manifest and its digests) works unchanged. A file that
cannot be linked (another filesystem, the inode's link limit) is copied and counted as such.
A job deleted while another links its files: a link to a removed file fails, the reusing job
drops what it linked and settles again (never a partial set).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from service.config import Settings
from service.errors import ObjectNotFound
from service.jobs.artifact_store import ArtifactStore
from service.jobs.layout import JobLayout
from service.jobs.model import Artifact, Job
from service.jobs.spec import JobSpec
from service.jobs.store import JobStore, ReuseAction
from service.jobs.versions import producers
from service.objectstore import S3Location
from service.sources import SourceIdentity
from service.stage import JobContext, Phase

log = logging.getLogger(__name__)

KEY_FORMAT = 2
"""Bump when what goes into a key changes meaning: older keys then match nothing."""

WAIT_POLL_SECONDS = 0.5
"""How often a job waiting for an identical running job looks at the store."""

_LINK_FALLBACK = {errno.EXDEV, errno.EMLINK, errno.EPERM, errno.ENOTSUP}
"""link() failures that mean "cannot link here", not "the file is gone": copy instead."""


def recipe_of(spec: JobSpec) -> dict[str, Any]:
    """What the job is asked to make, normalized: every option that changes the bytes."""
    recipe: dict[str, Any] = {
        "exports": [export.model_dump(mode="json") for export in spec.export_specs()],
        "verify": spec.verify,
    }
    if spec.verify_text is not None:  # absent otherwise: the keys of earlier jobs hold
        recipe["verify_text"] = spec.verify_text
    return recipe


def reuse_key(source_identity: str, spec: JobSpec, tenant: str | None = None) -> str:
    """The key identical results share (see the module docstring)."""
    document = {
        "format": KEY_FORMAT,
        "tenant": tenant,
        "source": source_identity,
        "recipe": recipe_of(spec),
        "producers": producers(),
    }
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class SharedArtifactsGone(Exception):
    """The job chosen for reuse lost a file before every link was made (deleted meanwhile)."""


@dataclass
class StoreReuse:
    """The pipeline's :class:`service.jobs.pipeline.ReuseGate` on top of the job store."""

    store: JobStore
    layout: JobLayout
    settings: Settings
    poll_seconds: float = WAIT_POLL_SECONDS

    def settle(
        self, source: SourceIdentity, spec: JobSpec, ctx: JobContext
    ) -> list[Artifact] | None:
        """The artifacts this job shares with an identical one, or None if it computes them.

        Waits (abortable, within the job's time limit) while an identical job is running."""
        identity = source.key
        key = reuse_key(identity, spec, self.store.get(ctx.job_id).tenant)
        unusable: set[str] = set()  # jobs whose files turned out to be gone
        waited: list[str] = []
        started = time.monotonic()
        while True:
            ctx.check_abort()
            decision = self.store.settle_reuse(
                ctx.job_id, key, reuse=spec.reuse, exclude=unusable
            )
            section: dict[str, Any] = {"key": key, "source": identity}
            if waited:
                section["waited_for"] = waited
                section["waited_seconds"] = round(time.monotonic() - started, 3)
            if decision.action is ReuseAction.COMPUTE:
                ctx.set_detail("reuse", section)
                return None
            other = decision.other
            assert other is not None
            if decision.action is ReuseAction.WAIT:
                if other.id not in waited:
                    waited.append(other.id)
                    log.info("waiting for an identical job", extra={"job_id": ctx.job_id,
                                                                     "identical": other.id})
                    ctx.set_detail("reuse", {**section, "waiting_for": other.id})
                time.sleep(self.poll_seconds)
                continue
            try:
                artifacts = self._share(other, ctx)
            except SharedArtifactsGone:
                log.info("the job to reuse lost its files; settling again",
                         extra={"job_id": ctx.job_id, "identical": other.id})
                unusable.add(other.id)
                continue
            ctx.set_detail("reuse", {**section, "reused_from": other.id})
            if "model" in other.details:  # the same checkpoint: what the computing job read
                ctx.set_detail("model", other.details["model"])
            same_source = {k: v for k, v in other.details.get("source", {}).items()
                           if k in ("revision", "sha256", "format", "files", "bytes")}
            ctx.set_detail("source", {**same_source, "uri": spec.source, "identity": identity})
            return artifacts

    def _share(self, other: Job, ctx: JobContext) -> list[Artifact]:
        """Link ``other``'s artifacts into this job's staging, then publish them at once; or,
        when ``other`` published to the artifact store, copy its objects server-side."""
        published = other.details.get("artifact_store")
        if isinstance(published, dict) and published.get("uri"):
            return self._share_objects(other, str(published["uri"]), ctx)
        source = JobLayout.for_job(self.settings, other.id).artifacts
        staging = self.layout.staging
        ctx.set_phase(Phase.FINALIZE, total=len(other.artifacts), unit="files")
        linked = copied = 0
        try:
            for artifact in other.artifacts:
                src, dst = source / artifact.path, staging / artifact.path
                dst.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(src, dst)
                    linked += artifact.size
                except FileNotFoundError as exc:
                    raise SharedArtifactsGone(str(src)) from exc
                except OSError as exc:
                    if exc.errno not in _LINK_FALLBACK:
                        raise
                    shutil.copyfile(src, dst)
                    copied += artifact.size
                if dst.stat().st_size != artifact.size:
                    raise SharedArtifactsGone(f"{src} is not the size its job recorded")
                ctx.advance(1)
        except SharedArtifactsGone:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True, exist_ok=True)
            raise
        self.layout.publish()
        ctx.set_metric("reused_bytes", linked + copied)
        ctx.set_metric("reused_bytes_copied", copied)
        return list(other.artifacts)

    def _share_objects(self, other: Job, uri: str, ctx: JobContext) -> list[Artifact]:
        """Server-side copies of ``other``'s objects under this job's location, manifest last:
        no byte passes through the job. Each job then owns its objects (DELETE and retention
        of one never touch the other's)."""
        store = ArtifactStore.configured(self.settings)
        if store is None:
            raise SharedArtifactsGone(f"{uri}: no artifact store is configured now")
        job = self.store.get(ctx.job_id)
        destination = job.spec.get("destination")
        target = store.location_for(ctx.job_id, job.tenant,
                                    destination if isinstance(destination, str) else None)
        ctx.set_phase(Phase.FINALIZE, total=len(other.artifacts), unit="files")
        try:
            store.copy(S3Location.parse(uri), target, [a.path for a in other.artifacts], ctx)
        except ObjectNotFound as exc:
            raise SharedArtifactsGone(str(exc)) from exc
        ctx.set_detail("artifact_store", {"uri": target.uri, "objects": len(other.artifacts),
                                          "copied_from": uri})
        ctx.set_metric("reused_bytes", sum(a.size for a in other.artifacts))
        ctx.set_metric("reused_bytes_copied", 0)
        return list(other.artifacts)
