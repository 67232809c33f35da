#!/usr/bin/env bash
# Set up (if needed) and run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/flodl-zmq demo "$@"
