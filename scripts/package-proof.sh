#!/usr/bin/env bash
# Proves that a service can depend on the published crates by version alone, before they are
# published: packages them, serves them from a local registry, and builds, lints, tests and
# runs examples/standalone against that registry, offline.
#
#   scripts/package-proof.sh
#
# What it does, in order:
#   1. `cargo package` of the crates meant for users (rabbit-inbox, inbox-ops, inboxctl,
#      inbox-admin and the three forks in forks/), each verified by building it from its
#      .crate against the others just packaged;
#   2. a directory source in target/package-proof/registry: the workspace's crates.io
#      dependencies (`cargo vendor`) with the new .crate files unpacked beside them, each with
#      a .cargo-checksum.json naming the .crate's SHA-256;
#   3. examples/standalone (a workspace of its own whose Cargo.toml names only versions) with
#      crates.io replaced by that directory, offline: a fresh lockfile, fmt, clippy
#      -D warnings, the guide's doctests (the README and docs/ pages, compiled against the
#      standalone's dependency list), and a run of the service, which checks its exactly-once
#      effects against the PostgreSQL and RabbitMQ of DATABASE_URL and AMQP_URL;
#   4. that the standalone's dependency tree holds the lapin and amq-protocol forks and no
#      unforked lapin or amq-protocol;
#   5. that the ```toml block under "## Add it to your service" in README.md and the
#      standalone's [dependencies] agree, comments and blank lines aside.
# Builds go to target/package-proof/build, so reruns are incremental. It prints how long the
# packaging step took.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

published=(
  rabbit-inbox-fork-amq-protocol-types rabbit-inbox-fork-amq-protocol rabbit-inbox-fork-lapin
  rabbit-inbox inbox-ops inbox-admin inboxctl
)
target=$(cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
proof=$target/package-proof
registry=$proof/registry
standalone=$root/examples/standalone

step() { printf '\n==> %s\n' "$*"; }

step "package and verify: ${published[*]}"
start=$(date +%s)
# --allow-dirty: the proof is of the working tree, committed or not.
cargo package --allow-dirty $(printf -- '-p %s ' "${published[@]}")
echo "packaging took $(( $(date +%s) - start )) s"

step "a local registry in $registry"
# The workspace's crates.io dependencies (a superset of what the published crates need)...
cargo vendor --locked --versioned-dirs -q "$registry" >/dev/null
# ...and the packages themselves, as a registry would serve them.
version_of() {
  cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json,sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == sys.argv[1]))' "$1"
}
for name in "${published[@]}"; do
  crate=$target/package/$name-$(version_of "$name").crate
  rm -rf "$registry/$(basename "$crate" .crate)"
  tar -xzf "$crate" -C "$registry"
  printf '{"files":{},"package":"%s"}\n' "$(sha256sum "$crate" | cut -d' ' -f1)" \
    >"$registry/$(basename "$crate" .crate)/.cargo-checksum.json"
done

step "examples/standalone against the local registry, offline"
export CARGO_TARGET_DIR=$proof/build
cargo_proof() {
  cargo "$1" --offline --manifest-path "$standalone/Cargo.toml" \
    --config 'source.crates-io.replace-with="proof"' \
    --config "source.proof.directory=\"$registry\"" "${@:2}"
}
# The packages' checksums change with every build of them: resolve afresh every time.
rm -f "$standalone/Cargo.lock"
cargo_proof generate-lockfile
cargo fmt --manifest-path "$standalone/Cargo.toml" -- --check
cargo_proof clippy -q --all-targets -- -D warnings
cargo_proof test -q --doc
cargo_proof run -q

step "the dependent builds against the forks only"
tree=$(cargo_proof tree -e normal --prefix none)
for fork in rabbit-inbox-fork-lapin rabbit-inbox-fork-amq-protocol rabbit-inbox-fork-amq-protocol-types; do
  grep -q "^$fork v" <<<"$tree" || { echo "the standalone does not depend on $fork" >&2; exit 1; }
done
if grep -E '^(lapin|amq-protocol) v' <<<"$tree"; then
  echo "the standalone depends on an unforked lapin or amq-protocol (above)" >&2
  exit 1
fi

step "README.md's dependency list is the standalone's"
python3 - "$root/README.md" "$standalone/Cargo.toml" <<'EOF'
import re, sys

def dependencies(toml):
    """The [dependencies] table's lines, without comments, blank lines or spacing."""
    lines, inside = [], False
    for line in toml.splitlines():
        line = re.sub(r'\s+', ' ', line.split('#')[0]).strip()
        if line.startswith('['):
            inside = line == '[dependencies]'
        elif inside and line:
            lines.append(line)
    return lines

readme, manifest = (open(p).read() for p in sys.argv[1:])
section = readme.split('\n## Add it to your service\n', 1)
block = re.search(r'^```toml\n(.*?)^```', section[-1], re.S | re.M) if len(section) == 2 else None
if block is None:
    sys.exit('README.md has no ```toml block under "## Add it to your service"; '
             'add the [dependencies] of examples/standalone/Cargo.toml there')
want, have = dependencies(manifest), dependencies(block.group(1))
if want != have:
    print('README.md ("## Add it to your service") and examples/standalone/Cargo.toml list '
          'different [dependencies]; make them the same:', file=sys.stderr)
    for line in sorted(set(want) - set(have)):
        print(f'  only in the standalone: {line}', file=sys.stderr)
    for line in sorted(set(have) - set(want)):
        print(f'  only in the README:     {line}', file=sys.stderr)
    if set(want) == set(have):
        print('  (the same lines in another order)', file=sys.stderr)
    sys.exit(1)
print(f'{len(want)} dependencies, the same in both')
EOF

step "the packaged crates work for a dependent"
