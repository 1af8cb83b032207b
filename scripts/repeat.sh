#!/usr/bin/env bash
# Runs a command N times in a row and says how each run went: the check a change to a test
# suite passes before it is called done (a test that passes once may still depend on timing).
#
#   scripts/repeat.sh [--busy] N COMMAND...
#   scripts/repeat.sh 5 make test-e2e            # what `make test-e2e-repeat` runs
#   scripts/repeat.sh --busy 1 make test         # with every core kept busy meanwhile
#
# --busy keeps every core busy with an unrelated spinning process for the whole run, as a
# loaded CI machine would be. Every run is made (a flaky test shows how often it fails);
# the exit status is 1 if any run failed. Each run's output goes to its own log file.
set -u

busy=0
if [ "${1:-}" = "--busy" ]; then
    busy=1
    shift
fi
if [ $# -lt 2 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 [--busy] N COMMAND..." >&2
    exit 2
fi
runs=$1
shift

logs=$(mktemp -d "${TMPDIR:-/tmp}/repeat.XXXXXX")
spinners=()
stop_spinners() {
    for pid in "${spinners[@]}"; do kill "$pid" 2>/dev/null; done
    wait "${spinners[@]}" 2>/dev/null
}
trap stop_spinners EXIT
if [ "$busy" = 1 ]; then
    for _ in $(seq "$(nproc)"); do
        python3 -c 'while True: pass' &
        spinners+=($!)
    done
    echo "keeping $(nproc) cores busy (pids ${spinners[*]})"
fi

failed=0
summary=()
for i in $(seq "$runs"); do
    log="$logs/run-$i.log"
    echo "== run $i of $runs: $* (load average $(cut -d' ' -f1-3 /proc/loadavg); log $log)"
    start=$(date +%s)
    "$@" >"$log" 2>&1
    status=$?
    took=$(($(date +%s) - start))
    tail -n 3 "$log"
    if [ "$status" = 0 ]; then
        summary+=("run $i: passed in ${took} s")
    else
        failed=$((failed + 1))
        summary+=("run $i: FAILED (exit $status) in ${took} s, see $log")
    fi
    echo "${summary[-1]}"
done
echo "== $((runs - failed)) of $runs runs passed$([ "$busy" = 1 ] && echo ', cores kept busy')"
printf '%s\n' "${summary[@]}"
[ "$failed" = 0 ]
