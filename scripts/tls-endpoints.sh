#!/usr/bin/env bash
# TLS endpoints beside the default servers, for the TLS tests and for trying rabbit-inbox over
# TLS: a RabbitMQ node with an AMQPS listener (client certificate required) and its management
# API over HTTPS, a PostgreSQL server with `ssl = on`, and the certificates they use, all
# generated here with openssl (a CA, a second CA nobody trusts, server certificates for
# localhost and 127.0.0.1, a client certificate). It never touches the default servers.
#
#   scripts/tls-endpoints.sh start    generate the certificates, start both servers
#   scripts/tls-endpoints.sh stop     stop what start started and remove its files
#   scripts/tls-endpoints.sh env      the variables the tests read (eval "$(... env)")
#
# RabbitMQ: node inbox-tls@localhost, AMQPS on 127.0.0.1:5691 and 127.0.0.2:5691 (the second
# address is not in the server certificate: a host name check must refuse it), distribution on
# 25691, management API on https://127.0.0.1:15691 (and 127.0.0.2; every address, as the
# management plugin binds one; guest stays loopback-only). PostgreSQL: port 5442 on the same two
# addresses, TLS only (hostssl, trust; database `inbox_mtls` also wants a client
# certificate). Everything lives under $RABBIT_INBOX_TLS_DIR (default /tmp/rabbit-inbox-tls).
set -euo pipefail

DIR=${RABBIT_INBOX_TLS_DIR:-/tmp/rabbit-inbox-tls}
NODE=inbox-tls@localhost
AMQPS_PORT=5691
DIST_PORT=25691
MGMT_PORT=15691
PG_PORT=5442
PG_BIN=${PG_BIN:-/usr/lib/postgresql/$(ls /usr/lib/postgresql | sort -V | tail -n 1)/bin}

as_node() {
  env RABBITMQ_NODENAME="$NODE" \
    RABBITMQ_NODE_PORT="$AMQPS_PORT" \
    RABBITMQ_DIST_PORT="$DIST_PORT" \
    RABBITMQ_CONFIG_FILE="$DIR/rabbitmq/rabbitmq.conf" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/rabbitmq/enabled_plugins" \
    RABBITMQ_MNESIA_BASE="$DIR/rabbitmq/mnesia" \
    RABBITMQ_LOG_BASE="$DIR/rabbitmq/log" \
    RABBITMQ_PID_FILE="$DIR/rabbitmq/pid" \
    "$@"
}

as_postgres() { runuser -u postgres -- "$@"; }

quiet() {
  local out
  out=$("$@" 2>&1) || { echo "$out" >&2; return 1; }
}

# A certificate for $1 (file stem) with subject CN $2, signed by CA $3, with extensions $4.
issue() {
  local stem=$1 cn=$2 ca=$3 ext=$4 certs=$DIR/certs
  openssl req -new -newkey rsa:2048 -nodes -subj "/CN=$cn" \
    -keyout "$certs/$stem.key" -out "$certs/$stem.csr" 2>/dev/null
  printf '%s\n' "$ext" >"$certs/$stem.ext"
  openssl x509 -req -in "$certs/$stem.csr" -CA "$certs/$ca.pem" -CAkey "$certs/$ca.key" \
    -CAcreateserial -days 2 -sha256 -extfile "$certs/$stem.ext" -out "$certs/$stem.pem" 2>/dev/null
  rm -f "$certs/$stem.csr" "$certs/$stem.ext"
}

certificates() {
  local certs=$DIR/certs
  mkdir -p "$certs"
  for ca in ca other-ca; do
    openssl req -x509 -new -newkey rsa:2048 -nodes -days 2 -sha256 \
      -subj "/CN=rabbit-inbox test $ca" -keyout "$certs/$ca.key" -out "$certs/$ca.pem" \
      -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
      2>/dev/null
  done
  issue server localhost ca "$(printf '%s\n' \
    basicConstraints=CA:FALSE keyUsage=digitalSignature,keyEncipherment \
    extendedKeyUsage=serverAuth subjectAltName=DNS:localhost,IP:127.0.0.1)"
  issue client guest ca "$(printf '%s\n' \
    basicConstraints=CA:FALSE keyUsage=digitalSignature,keyEncipherment extendedKeyUsage=clientAuth)"
  # A client certificate from a CA the servers do not trust.
  issue other-client guest other-ca "$(printf '%s\n' \
    basicConstraints=CA:FALSE keyUsage=digitalSignature,keyEncipherment extendedKeyUsage=clientAuth)"
  rm -f "$certs"/*.srl
  # Readable by the servers, which run as their own users.
  chmod 0644 "$certs"/*.pem
  chmod 0640 "$certs"/*.key
}

start_rabbitmq() {
  local d=$DIR/rabbitmq certs=$DIR/certs
  mkdir -p "$d/mnesia" "$d/log" "$d/certs"
  # The node's own copy of its key, owned by the user the server drops to.
  cp "$certs/ca.pem" "$certs/server.pem" "$certs/server.key" "$d/certs/"
  cat >"$d/rabbitmq.conf" <<EOF
listeners.tcp = none
listeners.ssl.1 = 127.0.0.1:$AMQPS_PORT
listeners.ssl.2 = 127.0.0.2:$AMQPS_PORT
ssl_options.cacertfile = $d/certs/ca.pem
ssl_options.certfile = $d/certs/server.pem
ssl_options.keyfile = $d/certs/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = true
management.ssl.port = $MGMT_PORT
management.ssl.ip = 0.0.0.0
management.ssl.cacertfile = $d/certs/ca.pem
management.ssl.certfile = $d/certs/server.pem
management.ssl.keyfile = $d/certs/server.key
EOF
  echo '[rabbitmq_management].' >"$d/enabled_plugins"
  chown -R rabbitmq:rabbitmq "$d"
  as_node rabbitmq-server -detached >/dev/null 2>&1
  for _ in $(seq 1 90); do
    if rabbitmqctl -q -n "$NODE" await_startup --timeout 2 >/dev/null 2>&1; then return 0; fi
    sleep 1
  done
  echo "node $NODE did not start; the end of its log ($d/log):" >&2
  tail -n 30 "$d"/log/*.log >&2 2>/dev/null || true
  return 1
}

start_postgres() {
  local d=$DIR/postgres certs=$DIR/certs
  mkdir -p "$d"
  cp "$certs/ca.pem" "$certs/server.pem" "$certs/server.key" "$d/"
  chmod 0600 "$d/server.key"
  chown -R postgres:postgres "$d"
  quiet as_postgres "$PG_BIN/initdb" -D "$d/data" -U postgres --auth=trust
  cat >>"$d/data/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1,127.0.0.2'
port = $PG_PORT
unix_socket_directories = '$d'
ssl = on
ssl_cert_file = '$d/server.pem'
ssl_key_file = '$d/server.key'
ssl_ca_file = '$d/ca.pem'
EOF
  # TLS only over TCP; database inbox_mtls also wants a client certificate from the CA.
  cat >"$d/data/pg_hba.conf" <<EOF
local all all trust
hostssl inbox_mtls all 127.0.0.0/8 trust clientcert=verify-ca
hostssl all all 127.0.0.0/8 trust
EOF
  quiet as_postgres "$PG_BIN/pg_ctl" -D "$d/data" -l "$d/log" -w -t 60 start
  quiet as_postgres "$PG_BIN/psql" -h "$d" -p "$PG_PORT" -U postgres -d postgres \
    -c 'CREATE DATABASE inbox_mtls'
}

start() {
  if [[ -e $DIR ]]; then stop; fi
  mkdir -p "$DIR"
  chmod 0755 "$DIR"
  certificates
  start_rabbitmq
  start_postgres
  env_vars
}

stop() {
  if rabbitmqctl -q -n "$NODE" ping >/dev/null 2>&1; then
    timeout 60 rabbitmqctl -q -n "$NODE" stop >/dev/null 2>&1 || true
  fi
  if [[ -s $DIR/rabbitmq/pid ]]; then
    pid=$(cat "$DIR/rabbitmq/pid")
    if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; fi
  fi
  if [[ -s $DIR/postgres/data/postmaster.pid ]]; then
    as_postgres "$PG_BIN/pg_ctl" -D "$DIR/postgres/data" -m fast -w stop >/dev/null 2>&1 || true
  fi
  rm -rf "$DIR"
}

env_vars() {
  cat <<EOF
RABBIT_INBOX_TLS_DIR=$DIR
RABBIT_INBOX_TLS_AMQP_URL=amqps://guest:guest@localhost:$AMQPS_PORT/%2f
RABBIT_INBOX_TLS_MANAGEMENT_URL=https://guest:guest@localhost:$MGMT_PORT
RABBIT_INBOX_TLS_DATABASE_URL=postgres://postgres@localhost:$PG_PORT/postgres
EOF
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  env) env_vars | sed 's/^/export /' ;;
  *)
    sed -n '2,17p' "$0"
    exit 64
    ;;
esac
