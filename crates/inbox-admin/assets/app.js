// The dashboard: calls the JSON API with the token kept in this tab's sessionStorage. Every
// value from the API is written with textContent, never parsed as HTML.
"use strict";

const TOKEN_KEY = "inbox-admin-token";
const $ = (id) => document.getElementById(id);
let current = null; // the message shown in the detail view
let listQuery = null; // the filter of the message list, and its next cursor

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

async function api(path, options = {}) {
  const headers = { Accept: "application/json" };
  if (token()) headers.Authorization = "Bearer " + token();
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method: options.method || "GET",
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    throw new Error(`${response.status}: ${data.error || response.statusText}`);
  }
  return data;
}

function showError(e) {
  $("error").textContent = e ? String(e.message || e) : "";
  $("error").hidden = !e;
}

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "" : String(text);
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

function link(row, text, onClick, cls) {
  const td = cell(row, "");
  const a = document.createElement("a");
  a.textContent = text;
  if (cls) a.className = cls;
  a.addEventListener("click", () => Promise.resolve().then(onClick).catch(showError));
  td.appendChild(a);
  return a;
}

function age(secs) {
  if (secs === null || secs === undefined) return "-";
  const s = Math.round(secs);
  if (s < 120) return s + "s";
  if (s < 7200) return Math.round(s / 60) + "m";
  if (s < 172800) return Math.round(s / 3600) + "h";
  return Math.round(s / 86400) + "d";
}

function when(t) {
  return t ? new Date(t).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z") : "";
}

function fill(tableId, items, render) {
  const body = $(tableId).querySelector("tbody");
  body.replaceChildren();
  for (const item of items) {
    const tr = document.createElement("tr");
    render(tr, item);
    body.appendChild(tr);
  }
}

async function loadStatus() {
  const report = await api("/api/v1/status");
  const perConsumer = new Map();
  for (const l of report.lines) {
    const c = perConsumer.get(l.consumer) ||
      { oldest: null, open: 0, stale: 0, failed: 0, dups: 0 };
    if (l.status !== "PROCESSED") {
      c.open += l.rows || 0;
      // Overdue rows only: parked rows, rows waiting for their retry and live leases are
      // not "unprocessed" in the sense of stuck.
      const overdue = l.overdue_age_secs;
      if (overdue !== null && overdue !== undefined && (c.oldest === null || overdue > c.oldest)) {
        c.oldest = overdue;
      }
    }
    c.stale += l.stale;
    c.failed += l.failed_last_hour;
    c.dups += l.duplicates_last_hour;
    perConsumer.set(l.consumer, c);
  }
  fill("consumers", [...perConsumer.entries()], (tr, [name, c]) => {
    cell(tr, name);
    cell(tr, age(c.oldest), "num");
    cell(tr, c.open, "num");
    cell(tr, c.stale, c.stale > 0 ? "num bad" : "num");
    cell(tr, c.failed, "num");
    cell(tr, c.dups, "num");
  });
  fill("status", report.lines, (tr, l) => {
    cell(tr, l.consumer);
    link(tr, l.status, () => loadList({ consumer: l.consumer, status: l.status }));
    cell(tr, l.rows === null ? "-" : l.rows, "num");
    cell(tr, age(l.oldest_age_secs), "num");
    cell(tr, l.stale, "num");
    cell(tr, l.failed_last_hour, "num");
    cell(tr, l.duplicates_last_hour, "num");
    cell(tr, l.conflicts_last_hour, "num");
  });
  const b = report.broker;
  $("broker").textContent = b
    ? `work queue ${b.work.queue}: ${b.work.messages ?? "missing"} ready; ` +
      `parking lot ${b.parking.queue}: ${b.parking.messages ?? "missing"} ready`
    : "";
}

async function loadFailures() {
  const groups = await api("/api/v1/failures");
  fill("failures", groups, (tr, g) => {
    cell(tr, g.consumer);
    cell(tr, g.status);
    cell(tr, g.message_type);
    cell(tr, g.error_code || "");
    cell(tr, g.rows, "num");
    cell(tr, when(g.last_failed_at));
    link(tr, g.sample_message_id, () => showMessage(g.consumer, g.sample_message_id), "sample");
    link(tr, "list", () => loadList({
      consumer: g.consumer, status: g.status, type: g.message_type,
      error_code: g.error_code || "",
    }));
  });
}

async function loadList(filter, cursor) {
  listQuery = filter;
  const params = new URLSearchParams(filter);
  if (cursor) params.set("cursor", cursor);
  const page = await api("/api/v1/messages?" + params);
  $("list-section").hidden = false;
  $("list-title").textContent = "Messages: " +
    Object.entries(filter).filter(([, v]) => v).map(([k, v]) => `${k}=${v}`).join(", ");
  fill("messages", page.rows, (tr, r) => {
    link(tr, r.message_id, () => showMessage(r.consumer_name, r.message_id), "message");
    cell(tr, r.consumer_name);
    cell(tr, r.message_type);
    cell(tr, r.status);
    cell(tr, r.processing_attempt, "num");
    cell(tr, r.last_error_code || "");
    cell(tr, when(r.first_received_at));
  });
  $("next-page").hidden = !page.next_cursor;
  $("next-page").onclick = () => loadList(listQuery, page.next_cursor).catch(showError);
}

async function showMessage(consumer, id) {
  showError(null);
  const path = `/api/v1/messages/${encodeURIComponent(consumer)}/${encodeURIComponent(id)}`;
  const report = await api(path);
  const row = report.rows[0];
  current = row || null;
  $("detail-section").hidden = false;
  $("detail-id").textContent = id;
  const dl = $("detail");
  dl.replaceChildren();
  const field = (k, v) => {
    const dt = document.createElement("dt");
    dt.textContent = k;
    const dd = document.createElement("dd");
    dd.textContent = v === null || v === undefined ? "" : String(v);
    dd.dataset.field = k;
    dl.append(dt, dd);
  };
  if (row) {
    field("consumer", row.consumer_name);
    field("type", `${row.message_type} v${row.message_version}`);
    field("status", row.status);
    field("broker", row.location.queue
      ? `${row.location.place} (${row.location.queue})` : row.location.place);
    field("attempts", row.processing_attempt);
    field("deliveries", row.delivery_count);
    if (row.parked_copy_at || row.parked_duplicates) {
      field("parked copy", `${row.parked_copy_at ? "confirmed " + when(row.parked_copy_at) + ", " : ""}${row.parked_duplicates} duplicate(s) acked`);
    }
    if (row.retry_due_at || row.retry_duplicates) {
      field("pending retry", `${row.retry_due_at ? "due " + when(row.retry_due_at) + ", " : ""}${row.retry_duplicates} duplicate(s) acked`);
    }
    field("first received", when(row.first_received_at));
    field("attempt started", when(row.processing_started_at));
    if (row.lease_owner) {
      field("lease", `${row.lease_owner}, token ${row.fencing_token}, expires ${when(row.lease_expires_at)}`);
    }
    field("last failed", when(row.last_failed_at));
    field("error code", row.last_error_code);
    field("error", row.last_error_message);
    field("aggregate", [row.aggregate_type, row.aggregate_id].filter(Boolean).join(" "));
    field("tenant", row.tenant_id);
    field("correlation id", row.correlation_id);
    const p = row.payload;
    $("detail-payload").textContent = !p ? "(not kept)"
      : p.encoding === "utf8" ? p.data
      : p.encoding === "sealed" ? `(encrypted with key ${p.data.key_id}, not shown: ${p.data.reason})`
      : "base64:" + p.data;
  } else {
    for (const t of report.tombstones) {
      field("tombstone", `${t.final_status} (${t.message_type}), removed ${when(t.removed_at)}`);
    }
    $("detail-payload").textContent = "(row removed by retention)";
  }
  fill("audit", report.audit, (tr, a) => {
    cell(tr, when(a.occurred_at));
    cell(tr, a.actor);
    cell(tr, a.action);
    cell(tr, a.reason);
    cell(tr, a.ticket || "");
  });
  const parked = row && ["PERMANENT_FAILED", "POISONED", "MANUAL_REVIEW"].includes(row.status);
  $("actions").hidden = !parked;
  $("redrive-result").replaceChildren();
  $("redrive-run").disabled = true;
  $("detail-section").scrollIntoView();
}

function redriveBody(dryRun) {
  return {
    dry_run: dryRun,
    reason: $("reason").value,
    consumer: current.consumer_name,
    type: current.message_type,
    error_code: current.last_error_code || undefined,
  };
}

function showRedrive(report) {
  const out = $("redrive-result");
  out.replaceChildren();
  const summary = document.createElement("p");
  summary.id = "redrive-summary";
  const counts = (m) => Object.entries(m).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
  summary.textContent = (report.dry_run ? "Dry run: " : "Done: ") +
    `${report.examined} of ${report.parked_at_start} parked copies examined; ` +
    `classes: ${counts(report.classes)}; actions: ${counts(report.actions)}`;
  out.appendChild(summary);
  if (report.findings.length) {
    const table = document.createElement("table");
    table.id = "redrive-findings";
    for (const f of report.findings) {
      const tr = document.createElement("tr");
      cell(tr, f.message_id || "(no key)");
      cell(tr, f.class);
      cell(tr, f.action);
      cell(tr, f.detail);
      table.appendChild(tr);
    }
    out.appendChild(table);
  }
}

async function redrive(dryRun) {
  showError(null);
  if (!current) return;
  const report = await api("/api/v1/redrive", { method: "POST", body: redriveBody(dryRun) });
  showRedrive(report);
  $("redrive-run").disabled = !dryRun || !(report.actions.would_move > 0);
  if (!dryRun) await refresh();
}

async function refresh() {
  showError(null);
  await Promise.all([loadStatus(), loadFailures()]);
}

$("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value);
  $("token").value = "";
  refresh().catch(showError);
});
$("token-clear").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  refresh().catch(showError);
});
$("refresh").addEventListener("click", () => refresh().catch(showError));
$("redrive-preview").addEventListener("click", () => redrive(true).catch(showError));
$("redrive-run").addEventListener("click", () => redrive(false).catch(showError));
refresh().catch(showError);
