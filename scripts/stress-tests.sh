#!/usr/bin/env bash
# The flake hunt: run the cluster layer N times (default 5), as scripts/test.sh runs it (three
# workers), beside LOAD busy processes (default 2), then print each test that failed and in how
# many runs. A test that waits on a guess of this machine's speed, not on an event, shows up
# here. Extra arguments go to pytest.
#   bash scripts/stress-tests.sh 5 2
#   bash scripts/stress-tests.sh 3 4 -k chaos
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
load=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
case "$runs$load" in *[!0-9]*) echo "usage: scripts/stress-tests.sh [N] [LOAD] [pytest args...]" >&2; exit 2;; esac
bash scripts/setup.sh

out=$(mktemp -d /tmp/flodl-stress.XXXXXX)
burners=()
stop_load() { [ ${#burners[@]} -eq 0 ] || kill "${burners[@]}" 2>/dev/null || true; }
trap stop_load EXIT
for _ in $(seq "$load"); do
  .venv/bin/python -c 'while True: pass' &
  burners+=($!)
done

echo "stress: $runs run(s) of tests/cluster beside $load busy process(es); logs in $out"
failed_runs=0
for i in $(seq "$runs"); do
  start=$(date +%s)
  if .venv/bin/python -m pytest -q -p no:cacheprovider -rf -n 3 --dist loadgroup tests/cluster "$@" \
      > "$out/run$i.log" 2>&1; then
    verdict=passed
  else
    verdict=FAILED; failed_runs=$((failed_runs + 1))
  fi
  echo "run $i: $verdict in $(( $(date +%s) - start )) s: $(tail -n 1 "$out/run$i.log")"
done
stop_load

echo
if grep -h '^FAILED \|^ERROR ' "$out"/run*.log | sed 's/ - .*//' | sort | uniq -c | sort -rn | grep .; then
  echo "stress: $failed_runs of $runs run(s) failed (counts above: runs in which each test failed)"
  exit 1
fi
echo "stress: no failure in $runs run(s)"
