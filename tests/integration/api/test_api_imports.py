"""The API process does not import torch: job processes do (forked from a forkserver that
preloads it), and torch would cost the API process about 200 MB of RSS that it never uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

API_PROCESS = """
import json, sys, traceback
from pathlib import Path

torch_imported_by = []

def audit(event, args):
    if event == "import" and args[0] == "torch" and not torch_imported_by:
        stack = traceback.extract_stack()[:-1]
        torch_imported_by.extend(f"{f.filename}:{f.lineno}" for f in stack if "/service/" in f.filename)

sys.addaudithook(audit)

from fastapi.testclient import TestClient

from service.api.app import create_app
from service.config import Settings

checkpoint, data_dir = Path(sys.argv[1]), Path(sys.argv[2])
app = create_app(Settings(data_dir=data_dir, local_roots=[checkpoint.parent]))
with TestClient(app) as client:
    exports = [{"format": "safetensors", "dtype": "bfloat16"}, {"format": "gguf", "type": "q8_0"},
               {"format": "nnef"}]
    response = client.post("/v1/jobs", json={"source": checkpoint.as_uri(), "exports": exports})
    print(json.dumps({"status": response.status_code, "body": response.text,
                      "torch": "torch" in sys.modules, "imported_by": torch_imported_by}))
"""


def test_an_api_process_that_took_a_submit_has_not_imported_torch(
    llama_safetensors_dir: Path, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELPREP_")}
    out = subprocess.run(
        [sys.executable, "-c", API_PROCESS, str(llama_safetensors_dir), str(tmp_path / "data")],
        capture_output=True, text=True, check=True, cwd=ROOT, env=env, timeout=120,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["status"] == 202, result["body"]
    assert not result["torch"], "torch imported by " + " <- ".join(reversed(result["imported_by"]))
