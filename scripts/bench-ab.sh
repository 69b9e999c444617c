#!/usr/bin/env bash
# Before/after benchmark in one script: builds `inbox-lab` (release) from two revisions and
# runs their benchmarks alternately on this machine, so both meet the same load and the same
# servers, then prints each mode's medians and the ratio after/before.
#
#   scripts/bench-ab.sh BASE [HEAD] [-- BENCH-ARGS...]
#
#   BASE        a git revision (the "before"), e.g. main~3 or a commit id
#   HEAD        a git revision (the "after"); default: the working tree as it is
#   BENCH-ARGS  passed to `inbox-lab bench` (default: --modes per-message,batch --messages 20000)
#   ROUNDS=N    alternating rounds (default 5): each round runs before, then after, one run each
#
# Builds into target/bench-ab (a shared target directory, so dependencies build once; the
# binaries are copied out per revision). Figures: deliveries per second, p99 latency and CPU milliseconds
# per 1,000 messages (consumer process, and all processes), medians over the rounds. The
# throughput of one run moves by tens of percent on a shared machine; CPU per message moves
# less and is the figure to compare first.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."

usage() { sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; }
[ $# -ge 1 ] || { usage >&2; exit 2; }
case $1 in -h | --help) usage; exit 0 ;; esac
base=$1; shift
head=""
if [ $# -ge 1 ] && [ "$1" != "--" ]; then head=$1; shift; fi
[ "${1:-}" = "--" ] && shift
bench_args=("$@")
[ ${#bench_args[@]} -gt 0 ] || bench_args=(--modes per-message,batch --messages 20000)
rounds=${ROUNDS:-5}
for rev in "$base" ${head:+"$head"}; do
  if ! git rev-parse --verify --quiet "$rev^{commit}" >/dev/null; then
    echo "not a revision of this repository: $rev (see --help)" >&2
    exit 2
  fi
done

work=target/bench-ab
mkdir -p "$work"
export CARGO_TARGET_DIR=$PWD/$work/target

# Builds revision $1 (empty: the working tree) and prints the path of its binary.
build() {
  local rev=$1 name src
  if [ -z "$rev" ]; then
    name=working-tree
    src=$PWD
  else
    name=$(git rev-parse --short "$rev^{commit}")
    src=$PWD/$work/src-$name
    [ -d "$src" ] || git worktree add -q --detach "$src" "$rev"
  fi
  (cd "$src" && cargo build -q --release -p inbox-lab) >&2
  cp "$CARGO_TARGET_DIR/release/inbox-lab" "$work/inbox-lab-$name"
  echo "$work/inbox-lab-$name"
}

cleanup() {
  for dir in "$work"/src-*; do
    [ -d "$dir" ] && git worktree remove --force "$dir"
  done
  return 0
}
trap cleanup EXIT

echo "building the before ($base) and the after (${head:-working tree})" >&2
before=$(build "$base")
after=$(build "$head")

results=$work/results.jsonl
: >"$results"
for round in $(seq 1 "$rounds"); do
  for side in before after; do
    bin=$before
    [ "$side" = after ] && bin=$after
    echo "round $round/$rounds: $side" >&2
    line=$("$bin" bench "${bench_args[@]}" --runs 1 --json \
      --schema "inbox_bench_ab_$side" --queue-prefix "inbox-bench-ab-$side" | tail -n 1)
    printf '{"side":"%s","report":%s}\n' "$side" "$line" >>"$results"
  done
done

python3 - "$results" <<'EOF'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
broken = [r["side"] for r in runs if r["report"].get("exactly_once") is False]
if broken:
    sys.exit(f"exactly-once check failed in a run of: {', '.join(broken)}")
figures = {}  # (mode, side) -> lists
for run in runs:
    for mode in run["report"].get("modes", []):
        key = (mode["mode"], run["side"])
        f = figures.setdefault(key, {"msgs_per_s": [], "p99_ms": [], "consumer": [], "total": []})
        f["msgs_per_s"].append(mode["msgs_per_s"])
        f["p99_ms"].append(mode["p99_ms"])
        f["consumer"].append(mode["cpu_ms_per_1k"]["consumer"])
        f["total"].append(mode["cpu_ms_per_1k"]["total"])
modes = list(dict.fromkeys(m for m, _ in figures))
print(f"{'mode':<47} {'figure':<20} {'before':>9} {'after':>9} {'after/before':>12}")
for mode in modes:
    b, a = figures.get((mode, "before")), figures.get((mode, "after"))
    if not b or not a:
        continue
    for name, label in [("msgs_per_s", "msgs/s"), ("p99_ms", "p99 ms"), ("consumer", "CPU ms/1k, consumer"), ("total", "CPU ms/1k, all")]:
        mb, ma = statistics.median(b[name]), statistics.median(a[name])
        if mb == 0 and ma == 0:
            continue  # not measured in this mode (a fixed-rate run has no CPU figures)
        spread_b = (max(b[name]) - min(b[name])) / mb if mb else 0
        spread_a = (max(a[name]) - min(a[name])) / ma if ma else 0
        ratio = ma / mb if mb else float("nan")
        print(f"{mode:<47} {label:<20} {mb:>9.1f} {ma:>9.1f} {ratio:>12.2f}   (spread {spread_b:.0%} / {spread_a:.0%})")
print(f"medians of {len(runs) // 2} alternating rounds; spread = (max - min) / median per side")
EOF
