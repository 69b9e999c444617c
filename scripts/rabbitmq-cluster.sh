#!/usr/bin/env bash
# A local three-node RabbitMQ cluster beside the default node, for the cluster tests and for
# trying rabbit-inbox on a cluster. It never touches the default node (port 5672).
#
#   scripts/rabbitmq-cluster.sh start        start nodes 1..3 and join them into one cluster
#   scripts/rabbitmq-cluster.sh stop         stop every node and remove its data and logs
#   scripts/rabbitmq-cluster.sh status       the cluster as node 1 sees it
#   scripts/rabbitmq-cluster.sh urls         the AMQP URLs, comma-separated (for AMQP_URL)
#   scripts/rabbitmq-cluster.sh start-node N start node N again (after a kill or a stop)
#   scripts/rabbitmq-cluster.sh pid N        the OS process id of node N (for SIGKILL)
#   scripts/rabbitmq-cluster.sh node N       node N's Erlang node name (for rabbitmqctl -n)
#
# Nodes are inbox-c1..3@localhost, AMQP on 5681..5683, distribution on 25681..25683; data,
# logs and configuration live under $RABBIT_INBOX_CLUSTER_DIR (default
# /tmp/rabbit-inbox-cluster), owned by the rabbitmq user, which the server drops to.
set -euo pipefail

DIR=${RABBIT_INBOX_CLUSTER_DIR:-/tmp/rabbit-inbox-cluster}
NODES=(1 2 3)

node_name() { echo "inbox-c$1@localhost"; }
amqp_port() { echo $((5680 + $1)); }
dist_port() { echo $((25680 + $1)); }

# Runs a RabbitMQ command as the rabbitmq user (whose Erlang cookie the nodes share) with
# node N's environment.
as_node() {
  local n=$1
  shift
  local d="$DIR/node$n"
  # The Debian wrappers drop to the rabbitmq user with `su` and keep the environment.
  env RABBITMQ_NODENAME="$(node_name "$n")" \
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 \
    RABBITMQ_NODE_PORT="$(amqp_port "$n")" \
    RABBITMQ_DIST_PORT="$(dist_port "$n")" \
    RABBITMQ_CONFIG_FILE="$d/rabbitmq.conf" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$d/enabled_plugins" \
    RABBITMQ_MNESIA_BASE="$d/mnesia" \
    RABBITMQ_LOG_BASE="$d/log" \
    RABBITMQ_PID_FILE="$d/pid" \
    "$@"
}

ctl() {
  local n=$1
  shift
  rabbitmqctl -q -n "$(node_name "$n")" "$@"
}

# Runs a command quietly; its output is shown only when it fails.
quiet() {
  local out
  out=$("$@" 2>&1) || { echo "$out" >&2; return 1; }
}

prepare() {
  local n=$1 d="$DIR/node$n"
  mkdir -p "$d/mnesia" "$d/log"
  # Its own listener (the system config pins 5672) and no plugins (the management plugin of
  # the default node would want the same HTTP port).
  printf 'listeners.tcp.default = 127.0.0.1:%s\nloopback_users.guest = true\n' \
    "$(amqp_port "$n")" >"$d/rabbitmq.conf"
  echo '[].' >"$d/enabled_plugins"
  chown -R rabbitmq:rabbitmq "$DIR"
}

# Waits until node N's application runs (await_startup alone would wait forever on a node
# whose application was stopped).
wait_running() {
  local n=$1
  for _ in $(seq 1 90); do
    if ctl "$n" await_startup --timeout 2 >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  echo "node $(node_name "$n") did not start; the end of its log ($DIR/node$n/log):" >&2
  tail -n 30 "$DIR/node$n"/log/*.log >&2 2>/dev/null || true
  return 1
}

# Launches node N without waiting: its application if the Erlang VM is up (after `stop_app`;
# `ping` answers then, `status` does not), else the whole node (after a kill, or the first time).
launch_node() {
  local n=$1
  if ctl "$n" ping >/dev/null 2>&1; then
    quiet ctl "$n" start_app &
  else
    prepare "$n"
    as_node "$n" rabbitmq-server -detached >/dev/null 2>&1
  fi
}

start_node() {
  launch_node "$1"
  wait_running "$1"
  wait
}

node_pid() {
  local n=$1 f="$DIR/node$1/pid"
  if [[ -s $f ]]; then
    cat "$f"
  else
    ctl "$n" eval 'list_to_integer(os:getpid()).'
  fi
}

# Every step checks its own status: `set -e` does not apply inside a function called from
# `||`, which is how `start` calls this one.
start_once() {
  mkdir -p "$DIR" || return 1
  # All nodes are launched before any is waited for: after the whole cluster went down (a
  # killed run), a clustered node does not finish booting until its peers are back.
  for n in "${NODES[@]}"; do launch_node "$n" || return 1; done
  for n in "${NODES[@]}"; do wait_running "$n" || return 1; done
  wait
  for n in "${NODES[@]:1}"; do
    if ! ctl "$n" cluster_status --formatter json 2>/dev/null | grep -q "$(node_name 1)"; then
      quiet ctl "$n" stop_app || return 1
      quiet ctl "$n" reset || return 1
      quiet ctl "$n" join_cluster "$(node_name 1)" || return 1
      quiet ctl "$n" start_app || return 1
      wait_running "$n" || return 1
    fi
  done
}

# A cluster that does not come up (a node left in a state it cannot boot from) is removed and
# started once more from fresh nodes.
start() {
  if ! start_once; then
    echo "the cluster did not start; removing it and starting fresh nodes" >&2
    stop
    start_once
  fi
  ctl 1 cluster_status | sed -n '1,12p'
  echo "AMQP_URL=$(urls)"
}

stop() {
  for n in "${NODES[@]}"; do
    if ctl "$n" ping >/dev/null 2>&1; then
      timeout 60 rabbitmqctl -q -n "$(node_name "$n")" stop >/dev/null 2>&1 || true
    fi
    # A node killed and never restarted leaves nothing to stop; one that is hung is killed.
    if [[ -s $DIR/node$n/pid ]]; then
      pid=$(cat "$DIR/node$n/pid")
      if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
    fi
  done
  rm -rf "$DIR"
}

urls() {
  local out=()
  for n in "${NODES[@]}"; do out+=("amqp://guest:guest@127.0.0.1:$(amqp_port "$n")/%2f"); done
  (IFS=,; echo "${out[*]}")
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) ctl 1 cluster_status ;;
  urls) urls ;;
  start-node) start_node "${2:?node number}" ;;
  pid) node_pid "${2:?node number}" ;;
  node) node_name "${2:?node number}" ;;
  *)
    sed -n '2,14p' "$0"
    exit 64
    ;;
esac
