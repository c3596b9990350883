"""Healthy when the buckets exist (the entrypoint's ready file) and the S3 gateway answers: an
unsigned request gets 403 once identities are enforced, which is the answer wanted here."""

import sys
import urllib.error
import urllib.request
from pathlib import Path

if not Path("/tmp/objectstore.ready").exists():
    sys.exit("buckets not created yet")
try:
    urllib.request.urlopen("http://127.0.0.1:8333/", timeout=4)
except urllib.error.HTTPError as exc:
    sys.exit(0 if exc.code == 403 else f"S3 gateway answered {exc.code}")
except OSError as exc:
    sys.exit(f"S3 gateway does not answer: {exc}")
sys.exit("S3 gateway answered an unsigned request: identities are not enforced")
