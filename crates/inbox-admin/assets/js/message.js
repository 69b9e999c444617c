// One message: its row, where it is on the broker, its timeline, payload, headers and audit
// trail, with the redrive of its failure group and edit-and-replay when it is parked.

import { api, messagePath } from "./api.js";
import { $, action, cell, el, fill } from "./dom.js";
import { EditReplay } from "./edit-replay.js";
import { when } from "./format.js";
import { showError } from "./page-error.js";
import { GroupRedrive } from "./group-redrive.js";
import { PROCESSED, isParked } from "./statuses.js";

const KIND_LABELS = Object.freeze({
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
});

const HIDDEN_PAYLOAD = "(hidden: this token lacks the read:payload scope)";

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

/** A term of the detail list, its value a link when `onClick` is given. */
function field(k, v, onClick) {
  if (v === null || v === undefined || v === "") return; // nothing to say
  const dt = el("dt", k);
  const dd = el("dd", onClick ? null : v);
  if (onClick) dd.appendChild(action(v, onClick));
  dd.dataset.field = k;
  $("detail").append(dt, dd);
}

function showRow(row, report, timeline, open) {
  field("consumer", row.consumer_name);
  field("type", `${row.message_type} v${row.message_version}`);
  field("status", row.status);
  if (timeline.replaced_by) {
    field("replaced by", timeline.replaced_by, () => open(timeline.replaced_by));
  }
  if (timeline.replaces) {
    field("replaces", timeline.replaces, () => open(timeline.replaces));
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
  if (row.status === PROCESSED && row.last_error_code) {
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
  $("detail-payload").textContent = report.payload_hidden ? HIDDEN_PAYLOAD
    : !p ? "(not kept)"
    : p.encoding === "utf8" ? p.data
    : p.encoding === "sealed" ? `(encrypted with key ${p.data.key_id}, not shown: ${p.data.reason})`
    : "base64:" + p.data;
  $("detail-headers").textContent = report.payload_hidden ? HIDDEN_PAYLOAD
    : JSON.stringify(row.headers, null, 2);
}

function showTombstones(report) {
  for (const t of report.tombstones) {
    field("tombstone", `${t.final_status} (${t.message_type}), removed ${when(t.removed_at)}`);
  }
  $("detail-payload").textContent = "(row removed by retention)";
  $("detail-headers").textContent = "";
}

export class MessageView {
  #groupRedrive;
  #editReplay;
  #openMessage;

  /**
   * `openMessage(consumer, id)` opens another message; `afterAction()` is awaited once an
   * action changed the inbox.
   */
  constructor(openMessage, afterAction) {
    this.#openMessage = openMessage;
    this.#groupRedrive = new GroupRedrive(afterAction);
    this.#editReplay = new EditReplay(openMessage);
  }

  /** Reads the message and shows it. */
  async show(consumer, id) {
    showError(null);
    const [report, timeline] = await Promise.all([
      api(messagePath(consumer, id)),
      api(messagePath(consumer, id) + "/timeline"),
    ]);
    const row = report.rows[0] || null;
    $("detail-section").hidden = false;
    $("bulk-section").hidden = true;
    $("detail-id").textContent = id;
    $("detail").replaceChildren();
    if (row) {
      showRow(row, report, timeline, (other) => this.#openMessage(consumer, other));
    } else {
      showTombstones(report);
    }
    renderTimeline(timeline);
    fill("audit", report.audit, (tr, a) => {
      cell(tr, when(a.occurred_at));
      cell(tr, a.actor);
      cell(tr, a.action);
      cell(tr, a.reason);
      cell(tr, a.ticket || "");
    });
    const p = row && row.payload;
    const body = !report.payload_hidden && p && p.encoding === "utf8" ? p.data : null;
    const parked = row !== null && isParked(row.status) && !timeline.replaced_by;
    this.#groupRedrive.show(row, parked);
    this.#editReplay.show(row, parked, body);
    $("detail-section").scrollIntoView();
  }
}
