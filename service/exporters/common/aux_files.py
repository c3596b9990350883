"""The checkpoint's config and tokenizer files, copied beside an export that needs them."""

from __future__ import annotations

import shutil
from pathlib import Path

from service.checkpoint.base import Checkpoint


def copy_aux_files(checkpoint: Checkpoint, out_dir: Path) -> list[str]:
    """Config and tokenizer files travel with the export; only regular files inside the root
    (or rewritten by the job: ``Checkpoint.rewritten``)."""
    root = checkpoint.root.resolve()
    copied = []
    for path in checkpoint.aux_files:
        src = path.resolve()
        trusted = src.is_relative_to(root) or path in checkpoint.rewritten
        if not trusted or not src.is_file() or (out_dir / src.name).exists():
            continue
        shutil.copyfile(src, out_dir / src.name)
        copied.append(src.name)
    return copied
