#!/usr/bin/env bash
# CPU seconds of a command and of every process under it, orphans included: a test's ranks come
# from a fork server pytest never reaps, so /usr/bin/time misses them. Linux, as root (a cgroup v1
# cpuacct hierarchy at /sys/fs/cgroup/cpuacct). Usage:
#   OMP_NUM_THREADS=1 bash bench/cpu_seconds.sh python3 -m pytest tests/distributed/test_hf_zoo.py -n 0 -q
set -u
group=/sys/fs/cgroup/cpuacct/cpu_seconds_$$
mkdir "$group" || { echo "cpu_seconds: cannot make $group (root and cgroup v1 cpuacct needed)" >&2; exit 1; }
start=$(date +%s.%N)
bash -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' _ "$group" "$@"
status=$?
sleep 1  # let processes the command left behind end, and their time be counted
end=$(date +%s.%N)
python3 -c "import sys; print(f'cpu_seconds: wall {float(sys.argv[2]) - float(sys.argv[1]) - 1:.1f} s, cpu {int(sys.argv[3]) / 1e9:.1f} s', file=sys.stderr)" \
    "$start" "$end" "$(cat "$group/cpuacct.usage")"
for pid in $(cat "$group/cgroup.procs"); do kill -9 "$pid" 2>/dev/null; done
rmdir "$group" 2>/dev/null
exit $status
