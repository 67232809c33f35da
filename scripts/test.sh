#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The run report's browser test (tests/browser) drives Debian's Chromium. Install it when we
# may (root with apt-get, as on CI); anyone else gets that one test skipped, with the reason.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
    || echo "scripts/test.sh: could not install chromium; the report's browser test will be skipped" >&2
fi
# Three workers on two cores: the cluster tests spend part of their time waiting on timeouts and
# links, not computing. The network-namespace tests of one module run one after another on one
# of them (tests/cluster/conftest.py), everything else beside them. --quick: every layer but cluster.
layers=()
if [ "${1:-}" = "--quick" ]; then
  shift
  layers=(-m "not cluster")
fi
exec .venv/bin/python -m pytest -q -n 3 --dist loadgroup "${layers[@]}" "$@"
