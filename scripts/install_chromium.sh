#!/usr/bin/env bash
# The headless browser the /ui tests drive (tests/e2e/test_ui.py): Debian's `chromium` package.
# Playwright's own browser download is never used (it would fetch from outside the package
# registries); the tests launch /usr/bin/chromium. A no-op when it is already installed.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "chromium is missing and this user cannot apt-get: install the Debian package 'chromium'" >&2
  exit 1
fi
"${as_root[@]}" apt-get update -q
DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -q --no-install-recommends chromium
