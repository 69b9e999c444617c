// The console: calls the JSON API with the token kept in this tab's sessionStorage. Every
// value from the API is written with textContent, never parsed as HTML. Charts are drawn by
// the bundled uPlot (window.uPlot).
"use strict";

const TOKEN_KEY = "inbox-admin-token";
const LIVE_MS = 5000;
const PARKED = ["PERMANENT_FAILED", "POISONED", "MANUAL_REVIEW"];
const ANY_STATUS = ["PROCESSING", "PROCESSED", "RETRYABLE_FAILED", ...PARKED].join(",");
const $ = (id) => document.getElementById(id);

let current = null; // the row shown in the detail view
let currentPayload = null; // its body as text, when the token may read it
let listQuery = null; // the message search's filter
let listRows = []; // the rows of the page shown
let bulkScope = null; // what a bulk action applies to
let liveTimer = null;
let lastStatus = null; // per consumer, from the latest status report
const charts = new Map(); // chart key -> uPlot
const xRanges = new Map(); // chart key -> [from, to] in seconds, for charts that span a window
const cards = new Map(); // consumer -> its overview card's elements

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

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function cell(row, text, cls) {
  const td = el("td", text === null || text === undefined ? "" : text, cls);
  row.appendChild(td);
  return td;
}

function link(row, text, onClick, cls) {
  const td = cell(row, "");
  td.appendChild(action(text, onClick, cls));
  return td;
}

function action(text, onClick, cls) {
  const a = el("a", text, cls);
  a.addEventListener("click", () => Promise.resolve().then(onClick).catch(showError));
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

function messagePath(consumer, id) {
  return `/api/v1/messages/${encodeURIComponent(consumer)}/${encodeURIComponent(id)}`;
}

// ---- views -------------------------------------------------------------------------------

function setView(view) {
  const overview = view === "overview";
  $("overview-section").hidden = !overview;
  $("search-section").hidden = overview;
  if (overview) {
    $("detail-section").hidden = true;
    $("bulk-section").hidden = true;
  }
  $("nav-overview").classList.toggle("current", overview);
  $("nav-messages").classList.toggle("current", !overview);
  if (overview) redrawCharts();
}

function route() {
  const hash = decodeURIComponent(location.hash.slice(1));
  if (hash.startsWith("message/")) {
    const [, consumer, ...id] = hash.split("/");
    setView("messages");
    return showMessage(consumer, id.join("/"));
  }
  setView(hash === "messages" ? "messages" : "overview");
  return Promise.resolve();
}

// ---- overview ----------------------------------------------------------------------------

async function loadStatus() {
  const report = await api("/api/v1/status");
  const perConsumer = new Map();
  for (const l of report.lines) {
    const c = perConsumer.get(l.consumer) ||
      { oldest: null, open: 0, stale: 0, failed: 0, dups: 0, byStatus: {} };
    if (l.status !== "PROCESSED") {
      c.open += l.rows || 0;
      c.byStatus[l.status] = l.rows || 0;
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
    link(tr, l.status, () => searchFor({ consumer: l.consumer, status: l.status }));
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
  lastStatus = perConsumer;
  return perConsumer;
}

// The server samples the queues every 15 s and keeps a day, so the chart has the night's
// history as soon as the page opens; a read also takes a fresh sample, so it moves live.
async function loadDepths() {
  const report = await api("/api/v1/depths?window=" + ($("window").value === "24h" ? "24h" : "1h"));
  if (!report.queues) return;
  const q = report.queues;
  const xs = report.samples.map((s) => Date.parse(s.at) / 1000);
  const pick = (k) => report.samples.map((s) => s[k] ?? null);
  const to = Date.now() / 1000;
  xRanges.set("depths", [to - ($("window").value === "24h" ? 86400 : 3600), to]);
  $("depth-card").hidden = false;
  drawChart("depths", $("depth-chart"), [
    { label: `work ready (${q.work})`, stroke: "#1450a0" },
    { label: "work unacked", stroke: "#7a5cc0" },
    { label: `retry tiers (${q.retry.length})`, stroke: "#d08a00" },
    { label: `parking lot (${q.parking})`, stroke: "#c9302c" },
  ], [xs, pick("work"), pick("work_unacked"), pick("retry"), pick("parking")]);
  $("depth-chart").dataset.samples = String(xs.length);
  // "Is it stuck?": ready messages with no consumer, or unacked ones that do not move.
  const last = report.samples[report.samples.length - 1];
  const now = !last || !last.via ? "the broker did not answer the last sample"
    : `now: ${last.work ?? "?"} ready, ${last.work_unacked ?? "?"} unacked, ` +
      `${last.work_consumers ?? "?"} consumers on ${q.work}` +
      (last.via === "amqp" ? " (ready counts through AMQP: the management API did not say)" : "");
  $("depth-now").textContent = now;
  $("depth-now").className = last && last.work_consumers === 0 && last.work > 0 ? "bad" : "muted";
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
    link(tr, g.sample_message_id, () => openMessage(g.consumer, g.sample_message_id), "sample");
    link(tr, "list", () => searchFor({
      consumer: g.consumer, status: g.status, type: g.message_type,
      error_code: g.error_code || "",
    }));
    const parked = PARKED.includes(g.status);
    const td = cell(tr, "");
    if (parked) {
      td.appendChild(action("bulk action", () => openBulk(
        { consumer: g.consumer, type: g.message_type, error_code: g.error_code || undefined },
        `the parked copies of consumer ${g.consumer}, type ${g.message_type}` +
          (g.error_code ? `, error code ${g.error_code}` : "") + ` (${g.rows} rows)`,
      ), "bulk"));
    }
  });
}

function windowParams() {
  return $("window").value === "24h" ? "window=24h&bucket=15m" : "window=1h&bucket=1m";
}

function drawChart(key, container, series, data) {
  let u = charts.get(key);
  const width = Math.max(320, container.clientWidth || 600);
  // Recreated when its series change (the latency chart's source can).
  if (u && (u.series.length !== series.length + 1 ||
      series.some((s, i) => u.series[i + 1].label !== s.label))) {
    u.destroy();
    u = null;
  }
  if (!u) {
    u = new uPlot({
      width,
      height: 180,
      series: [{}, ...series.map((s) => ({
        // Points are drawn where the data is sparse (uPlot's default), so a single busy
        // minute shows.
        label: s.label, stroke: s.stroke, width: 1.5, spanGaps: false,
      }))],
      // A chart given a window spans it, however few its samples (one sample would
      // otherwise stretch the axis over years).
      scales: { x: { time: true, range: (self, min, max) => xRanges.get(key) || [min, max] } },
      axes: [{}, { size: 56 }],
      legend: { live: false },
    }, data, container);
    charts.set(key, u);
  } else {
    u.setData(data);
  }
}

function redrawCharts() {
  for (const [key, u] of charts) {
    const box = key === "depths" ? $("depth-chart") : u.root.parentElement;
    if (box && box.clientWidth) u.setSize({ width: box.clientWidth, height: 180 });
  }
}

function consumerCard(consumer) {
  let card = cards.get(consumer);
  if (card) return card;
  const root = el("div", null, "card");
  root.dataset.consumer = consumer;
  const title = el("h3", consumer);
  const figures = el("div", null, "figures");
  const activity = el("div", null, "chart activity");
  const latency = el("div", null, "chart latency");
  root.append(title, figures, activity, latency);
  $("charts").appendChild(root);
  card = { root, figures, activity, latency };
  cards.set(consumer, card);
  return card;
}

function figure(box, label, value, cls) {
  const span = el("span", label + " ");
  const b = el("b", value);
  if (cls) b.className = cls;
  span.appendChild(b);
  box.appendChild(span);
}

async function loadActivity(perConsumer) {
  const report = await api("/api/v1/activity?" + windowParams());
  for (const c of report.consumers) {
    const card = consumerCard(c.consumer);
    const xs = c.buckets.map((b) => Date.parse(b.at) / 1000);
    const pick = (k) => c.buckets.map((b) => b[k]);
    const total = (k) => c.buckets.reduce((sum, b) => sum + (b[k] || 0), 0);
    const per = report.bucket_secs === 60 ? "per minute" : `per ${report.bucket_secs / 60} minutes`;
    drawChart(`activity:${c.consumer}`, card.activity, [
      { label: `processed ${per}`, stroke: "#1d6b2f" },
      { label: "duplicates", stroke: "#7a5cc0" },
      { label: "retried", stroke: "#d08a00" },
      { label: "parked", stroke: "#c9302c" },
      { label: "conflicts", stroke: "#333" },
    ], [xs, pick("processed"), pick("duplicates"), pick("retried"), pick("parked"),
      pick("conflicts")]);
    // The consumer's own histogram when Prometheus scrapes it, else the ledger's rows; the
    // two measure different spans, so the label says which one is drawn.
    const fromMetrics = (report.latency_sources || {})[c.consumer] === "metrics";
    drawChart(`latency:${c.consumer}`, card.latency, [
      {
        label: fromMetrics
          ? "p50 ms, receipt to settlement (consumer metrics)"
          : "p50 ms, first receipt to processed (ledger)",
        stroke: "#1450a0",
      },
      { label: "p99 ms", stroke: "#c9302c" },
    ], [xs, pick("latency_p50_ms"), pick("latency_p99_ms")]);
    card.latency.dataset.source = fromMetrics ? "metrics" : "ledger";
    const s = (perConsumer && perConsumer.get(c.consumer)) || { oldest: null, open: 0, byStatus: {} };
    card.figures.replaceChildren();
    figure(card.figures, "processed", total("processed"));
    figure(card.figures, "duplicates", total("duplicates"));
    figure(card.figures, "retried", total("retried"));
    figure(card.figures, "parked", total("parked"), total("parked") ? "bad" : "");
    figure(card.figures, "conflicts", total("conflicts"));
    figure(card.figures, "oldest unprocessed", age(s.oldest), s.oldest ? "bad" : "");
    const open = Object.entries(s.byStatus).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
    figure(card.figures, "open rows", open);
    // Read by tests and by anyone scripting the page: the charts' totals for the window.
    card.root.dataset.processed = String(total("processed"));
    card.root.dataset.parked = String(total("parked"));
  }
}

async function loadAlerts() {
  const report = await api("/api/v1/alerts");
  const box = $("alerts");
  box.replaceChildren();
  for (const a of report.alerts) {
    const banner = el("div", null, "banner " + (a.severity === "critical" ? "critical" : "warning"));
    banner.dataset.alert = a.name;
    const prefix = a.consumer && !a.summary.startsWith(a.consumer + ":") ? a.consumer + ": " : "";
    banner.append(el("strong", a.name), el("span", prefix + a.summary));
    box.appendChild(banner);
  }
  if (report.error) {
    box.appendChild(el("div", `alert source ${report.source}: ${report.error}`, "banner"));
  }
  box.dataset.source = report.source;
}

async function refresh() {
  showError(null);
  const [perConsumer] = await Promise.all([
    loadStatus(), loadFailures(), loadAlerts(), loadDepths(),
  ]);
  await loadActivity(perConsumer);
  $("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

function setLive() {
  clearInterval(liveTimer);
  liveTimer = $("live").checked
    ? setInterval(() => refresh().catch(showError), LIVE_MS)
    : null;
}

// ---- message search ----------------------------------------------------------------------

function searchFor(filter) {
  const form = $("search-form");
  for (const input of form.querySelectorAll("input, select")) {
    input.value = filter[input.name] || "";
  }
  location.hash = "messages";
  return loadList(filter);
}

function formFilter() {
  const filter = {};
  for (const input of $("search-form").querySelectorAll("input, select")) {
    if (input.value.trim()) filter[input.name] = input.value.trim();
  }
  // An id names one message whatever its state: look in every status, not only open rows.
  if (!filter.status && (filter.message_id || filter.correlation_id)) filter.status = ANY_STATUS;
  return filter;
}

async function loadList(filter, cursor) {
  listQuery = filter;
  const params = new URLSearchParams(filter);
  if (cursor) params.set("cursor", cursor);
  const page = await api("/api/v1/messages?" + params);
  setView("messages");
  listRows = page.rows;
  const terms = Object.entries(filter).filter(([, v]) => v).map(([k, v]) => `${k}=${v}`);
  $("search-summary").textContent = `${page.rows.length} message(s)` +
    (page.next_cursor ? " on this page, more on the next" : "") +
    (terms.length ? ` for ${terms.join(", ")}` : " (open rows)");
  fill("messages", page.rows, (tr, r) => {
    link(tr, r.message_id, () => openMessage(r.consumer_name, r.message_id), "message");
    cell(tr, r.consumer_name);
    cell(tr, r.message_type);
    cell(tr, r.status);
    cell(tr, r.processing_attempt, "num");
    cell(tr, r.last_error_code || "");
    cell(tr, when(r.first_received_at));
  });
  $("next-page").hidden = !page.next_cursor;
  $("next-page").onclick = () => loadList(listQuery, page.next_cursor).catch(showError);
  const parked = page.rows.filter((r) => PARKED.includes(r.status));
  $("search-bulk").hidden = parked.length === 0;
  $("search-bulk").onclick = () => openBulk(
    { consumer: filter.consumer, message_ids: parked.map((r) => r.message_id) },
    `${parked.length} parked message(s) of this page: ` +
      parked.slice(0, 5).map((r) => r.message_id).join(", ") + (parked.length > 5 ? ", ..." : ""),
  );
}

// ---- one message -------------------------------------------------------------------------

function openMessage(consumer, id) {
  const hash = `#message/${encodeURIComponent(consumer)}/${encodeURIComponent(id)}`;
  if (location.hash === hash) return showMessage(consumer, id);
  location.hash = hash; // route() shows it
  return Promise.resolve();
}

const KIND_LABELS = {
  received: "first received",
  attempt_started: "attempt started",
  failed: "attempt failed",
  parked: "attempt failed, parked",
  retry_due: "retry due",
  duplicate: "duplicate delivery dropped",
  conflict: "delivery with a different body",
  processed: "processed",
  parked_copy_confirmed: "parking-lot copy confirmed",
  recovered: "recovered",
  audit: "operator",
  scrubbed: "body, headers and error texts scrubbed by retention",
  removed: "removed by retention",
};

function timelineText(e) {
  const parts = [];
  if (e.attempt !== null && e.attempt !== undefined) parts.push(`attempt ${e.attempt}`);
  if (e.deliveries && e.kind !== "failed" && e.kind !== "parked") parts.push(`${e.deliveries} deliveries`);
  if (e.until) parts.push(`until ${when(e.until)}`);
  if (e.status) parts.push(e.status);
  if (e.error_code) parts.push(`error ${e.error_code}`);
  if (e.error_message) parts.push(`"${e.error_message}"`);
  if (e.retry_tier) parts.push(`waits in ${e.retry_tier}`);
  if (e.action) parts.push(`${e.action} by ${e.actor}: ${e.reason}` + (e.ticket ? ` [${e.ticket}]` : ""));
  return parts.join(", ");
}

function renderTimeline(timeline) {
  const list = $("timeline");
  list.replaceChildren();
  if (timeline.truncated) {
    const li = el("li", "older history left out: the newest entries are shown", "muted");
    li.dataset.kind = "truncated";
    list.appendChild(li);
  }
  for (const e of timeline.entries) {
    const li = el("li");
    li.dataset.kind = e.kind;
    if (e.action) li.dataset.action = e.action;
    li.append(el("time", when(e.at)), el("strong", KIND_LABELS[e.kind] || e.kind));
    const text = timelineText(e);
    if (text) li.append(document.createTextNode(" " + text));
    list.appendChild(li);
  }
}

function field(k, v, onClick) {
  if (v === null || v === undefined || v === "") return; // nothing to say
  const dt = el("dt", k);
  const dd = el("dd", onClick ? null : (v === null || v === undefined ? "" : v));
  if (onClick) dd.appendChild(action(v, onClick));
  dd.dataset.field = k;
  $("detail").append(dt, dd);
}

async function showMessage(consumer, id) {
  showError(null);
  const [report, timeline] = await Promise.all([
    api(messagePath(consumer, id)),
    api(messagePath(consumer, id) + "/timeline"),
  ]);
  const row = report.rows[0];
  current = row || null;
  currentPayload = null;
  $("detail-section").hidden = false;
  $("bulk-section").hidden = true;
  $("detail-id").textContent = id;
  $("detail").replaceChildren();
  if (row) {
    field("consumer", row.consumer_name);
    field("type", `${row.message_type} v${row.message_version}`);
    field("status", row.status);
    if (timeline.replaced_by) {
      field("replaced by", timeline.replaced_by, () => openMessage(consumer, timeline.replaced_by));
    }
    if (timeline.replaces) {
      field("replaces", timeline.replaces, () => openMessage(consumer, timeline.replaces));
    }
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
    const errorText = report.payload_hidden ? "(hidden: needs the read:payload scope)"
      : row.last_error_message;
    if (row.status === "PROCESSED" && row.last_error_code) {
      // A past failure (the row was retried, redriven or reopened and then processed), told
      // as past, as `inboxctl show` does: nothing here is failing now.
      field("last failure before it was processed",
        `${row.last_error_code} ${when(row.last_failed_at)}: ${errorText || ""}`);
    } else {
      field("last failed", when(row.last_failed_at));
      field("error code", row.last_error_code);
      field("error", errorText);
    }
    field("aggregate", [row.aggregate_type, row.aggregate_id].filter(Boolean).join(" "));
    field("tenant", row.tenant_id);
    field("correlation id", row.correlation_id);
    const p = row.payload;
    if (!report.payload_hidden && p && p.encoding === "utf8") currentPayload = p.data;
    $("detail-payload").textContent = report.payload_hidden
      ? "(hidden: this token lacks the read:payload scope)"
      : !p ? "(not kept)"
      : p.encoding === "utf8" ? p.data
      : p.encoding === "sealed" ? `(encrypted with key ${p.data.key_id}, not shown: ${p.data.reason})`
      : "base64:" + p.data;
    $("detail-headers").textContent = report.payload_hidden
      ? "(hidden: this token lacks the read:payload scope)"
      : JSON.stringify(row.headers, null, 2);
  } else {
    for (const t of report.tombstones) {
      field("tombstone", `${t.final_status} (${t.message_type}), removed ${when(t.removed_at)}`);
    }
    $("detail-payload").textContent = "(row removed by retention)";
    $("detail-headers").textContent = "";
  }
  renderTimeline(timeline);
  fill("audit", report.audit, (tr, a) => {
    cell(tr, when(a.occurred_at));
    cell(tr, a.actor);
    cell(tr, a.action);
    cell(tr, a.reason);
    cell(tr, a.ticket || "");
  });
  const parked = row && PARKED.includes(row.status) && !timeline.replaced_by;
  $("actions").hidden = !parked;
  $("redrive-result").replaceChildren();
  $("redrive-run").disabled = true;
  $("edit-section").hidden = !(parked && currentPayload !== null);
  if (!$("edit-section").hidden) {
    let body = currentPayload;
    try {
      body = JSON.stringify(JSON.parse(currentPayload), null, 2);
    } catch (_) {
      // Not JSON: edited as text.
    }
    $("edit-body").value = body;
  }
  $("edit-diff").replaceChildren();
  $("edit-result").textContent = "";
  $("edit-run").disabled = true;
  $("detail-section").scrollIntoView();
}

// ---- the message's group redrive ---------------------------------------------------------

function counts(m) {
  return Object.entries(m).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
}

function reportSummary(report) {
  return (report.dry_run ? "Dry run: " : "Done: ") +
    `${report.examined} of ${report.parked_at_start} parked copies examined; ` +
    `classes: ${counts(report.classes)}; actions: ${counts(report.actions)}`;
}

function findingsTable(report, id) {
  const table = el("table");
  table.id = id;
  for (const f of report.findings) {
    const tr = document.createElement("tr");
    cell(tr, f.message_id || "(no key)");
    cell(tr, f.class);
    cell(tr, f.action);
    cell(tr, f.detail);
    table.appendChild(tr);
  }
  return table;
}

function wouldAct(report) {
  const a = report.actions;
  return (a.would_move || 0) + (a.would_remove || 0) + (a.would_discard || 0) > 0;
}

async function redrive(dryRun) {
  showError(null);
  if (!current) return;
  const report = await api("/api/v1/redrive", {
    method: "POST",
    body: {
      dry_run: dryRun,
      reason: $("reason").value,
      consumer: current.consumer_name,
      type: current.message_type,
      error_code: current.last_error_code || undefined,
    },
  });
  const out = $("redrive-result");
  const summary = el("p", reportSummary(report));
  summary.id = "redrive-summary";
  out.replaceChildren(summary);
  if (report.findings.length) out.appendChild(findingsTable(report, "redrive-findings"));
  $("redrive-run").disabled = !dryRun || !wouldAct(report);
  if (!dryRun) await refresh();
}

// ---- bulk actions ------------------------------------------------------------------------

function openBulk(filter, label) {
  bulkScope = filter;
  location.hash = "messages";
  setView("messages");
  $("bulk-section").hidden = false;
  $("detail-section").hidden = true;
  $("bulk-scope").textContent = "Applies to " + label + ".";
  $("bulk-result").replaceChildren();
  $("bulk-run").disabled = true;
  $("bulk-progress").hidden = true;
  $("bulk-section").scrollIntoView();
}

function bulkBody(dryRun) {
  return {
    dry_run: dryRun,
    reason: $("bulk-reason").value,
    ticket: $("bulk-ticket").value || undefined,
    consumer: bulkScope.consumer || undefined,
    type: bulkScope.type || undefined,
    error_code: bulkScope.error_code || undefined,
    message_ids: bulkScope.message_ids || undefined,
  };
}

function showBulkReport(report) {
  const out = $("bulk-result");
  const summary = el("p", reportSummary(report));
  summary.id = "bulk-summary";
  out.replaceChildren(summary);
  if (report.findings.length) out.appendChild(findingsTable(report, "bulk-findings"));
}

async function bulkPreview() {
  showError(null);
  const report = await api("/api/v1/" + $("bulk-action").value, {
    method: "POST", body: bulkBody(true),
  });
  showBulkReport(report);
  $("bulk-run").disabled = !wouldAct(report);
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function bulkRun() {
  showError(null);
  $("bulk-run").disabled = true;
  const started = await api("/api/v1/jobs", {
    method: "POST",
    body: { action: $("bulk-action").value, ...bulkBody(false) },
  });
  const progress = $("bulk-progress");
  progress.hidden = false;
  progress.removeAttribute("value");
  let job = started;
  while (job.state === "running") {
    await sleep(250);
    job = await api("/api/v1/jobs/" + encodeURIComponent(started.id));
    if (job.total) {
      progress.max = job.total;
      progress.value = job.done;
    }
  }
  progress.hidden = true;
  if (job.state === "failed") throw new Error(job.error);
  showBulkReport(job.report);
  // This job's rows only: each carries the job's id (the actor and start time narrow the read).
  const audit = await api(`/api/v1/audit?job=${encodeURIComponent(job.id)}` +
    `&actor=${encodeURIComponent(job.actor)}&since=${encodeURIComponent(job.started_at)}`);
  const title = el("h3", `Audit trail of this run: ${audit.length} entr${audit.length === 1 ? "y" : "ies"}`);
  const table = el("table");
  table.id = "bulk-audit";
  for (const a of audit) {
    const tr = document.createElement("tr");
    cell(tr, when(a.occurred_at));
    cell(tr, a.action);
    if (a.consumer_name && a.message_id) {
      link(tr, a.message_id, () => openMessage(a.consumer_name, a.message_id));
    } else {
      cell(tr, a.message_id || "");
    }
    cell(tr, a.reason);
    cell(tr, a.ticket || "");
    table.appendChild(tr);
  }
  $("bulk-result").append(title, table);
  await refresh();
}

// ---- edit and replay ---------------------------------------------------------------------

function replayBody(dryRun) {
  return {
    body: $("edit-body").value,
    dry_run: dryRun,
    reason: $("edit-reason").value,
    ticket: $("edit-ticket").value || undefined,
  };
}

async function editReplay(dryRun) {
  showError(null);
  if (!current) return;
  const path = messagePath(current.consumer_name, current.message_id) + "/replay-edited";
  const report = await api(path, { method: "POST", body: replayBody(dryRun) });
  const diff = $("edit-diff");
  diff.replaceChildren();
  for (const line of report.diff) {
    const prefix = line.op === "add" ? "+ " : line.op === "remove" ? "- " : "  ";
    diff.appendChild(el("span", prefix + line.text.replace(/\n$/, ""), line.op));
  }
  const result = $("edit-result");
  result.replaceChildren();
  if (dryRun) {
    result.textContent = `Changed: ${report.changed_paths.join(", ") || "(text)"}. ` +
      `Replaying publishes it as ${report.replacement_id}.`;
    $("edit-run").disabled = false;
  } else {
    result.append(document.createTextNode(
      `Replayed as ${report.replacement_id}` +
        (report.parked_copy_removed ? "; the original's parked copy was removed. " : ". "),
    ), action("Open the replacement", () => openMessage(report.consumer, report.replacement_id), "replacement"));
    result.dataset.replacement = report.replacement_id;
    $("edit-run").disabled = true;
  }
}

// ---- wiring ------------------------------------------------------------------------------

$("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value);
  $("token").value = "";
  refresh().then(route).catch(showError);
});
$("token-clear").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  refresh().catch(showError);
});
$("refresh").addEventListener("click", () => refresh().catch(showError));
$("window").addEventListener("change", () => loadActivity(lastStatus).catch(showError));
$("live").addEventListener("change", setLive);
$("search-form").addEventListener("submit", (e) => {
  e.preventDefault();
  loadList(formFilter()).catch(showError);
});
$("redrive-preview").addEventListener("click", () => redrive(true).catch(showError));
$("redrive-run").addEventListener("click", () => redrive(false).catch(showError));
$("bulk-preview").addEventListener("click", () => bulkPreview().catch(showError));
$("bulk-run").addEventListener("click", () => bulkRun().catch(showError));
$("bulk-action").addEventListener("change", () => {
  $("bulk-run").disabled = true;
  $("bulk-result").replaceChildren();
});
$("edit-preview").addEventListener("click", () => editReplay(true).catch(showError));
$("edit-run").addEventListener("click", () => editReplay(false).catch(showError));
$("edit-body").addEventListener("input", () => {
  $("edit-run").disabled = true;
});
window.addEventListener("hashchange", () => route().catch(showError));
window.addEventListener("resize", redrawCharts);
setLive();
refresh().catch(showError);
route().catch(showError);
