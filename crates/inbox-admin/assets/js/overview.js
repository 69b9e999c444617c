// The overview: alert banners, a card per consumer with its activity and latency charts, the
// queue depths, the status tables and the failure groups; refreshed every few seconds while
// "live" is ticked.

import { api } from "./api.js";
import { Charts } from "./charts.js";
import { $, action, cell, el, fill, link } from "./dom.js";
import { age, when } from "./format.js";
import { reporting, showError } from "./page-error.js";
import { PROCESSED, isParked } from "./statuses.js";

const LIVE_MS = 5000;

function figure(box, label, value, cls) {
  const span = el("span", label + " ");
  const b = el("b", value);
  if (cls) b.className = cls;
  span.appendChild(b);
  box.appendChild(span);
}

export class Overview {
  #charts = new Charts();
  #cards = new Map(); // consumer -> its card's elements
  #perConsumer = null; // per consumer, from the latest status report
  #liveTimer = null;
  #links;

  /**
   * `links` leads elsewhere: `searchFor(filter)`, `openMessage(consumer, id)` and
   * `openBulk(scope, label)`.
   */
  constructor(links) {
    this.#links = links;
    $("refresh").addEventListener("click", () => reporting(() => this.refresh()));
    $("window").addEventListener("change",
      () => reporting(() => this.#loadActivity(this.#perConsumer)));
    $("live").addEventListener("change", () => this.#setLive());
    window.addEventListener("resize", () => this.#charts.resize());
    this.#setLive();
  }

  /** Reads everything the overview shows again. */
  async refresh() {
    showError(null);
    const [perConsumer] = await Promise.all([
      this.#loadStatus(), this.#loadFailures(), this.#loadAlerts(), this.#loadDepths(),
    ]);
    await this.#loadActivity(perConsumer);
    $("updated").textContent = "updated " + new Date().toLocaleTimeString();
  }

  /** Called when the overview is shown: charts drawn while it was hidden get their width. */
  shown() {
    this.#charts.resize();
  }

  #setLive() {
    clearInterval(this.#liveTimer);
    this.#liveTimer = $("live").checked
      ? setInterval(() => this.refresh().catch(showError), LIVE_MS)
      : null;
  }

  #windowIsDay() {
    return $("window").value === "24h";
  }

  async #loadStatus() {
    const report = await api("/api/v1/status");
    const perConsumer = new Map();
    for (const l of report.lines) {
      const c = perConsumer.get(l.consumer) ||
        { oldest: null, open: 0, stale: 0, failed: 0, dups: 0, byStatus: {} };
      if (l.status !== PROCESSED) {
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
      link(tr, l.status, () => this.#links.searchFor({ consumer: l.consumer, status: l.status }));
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
    this.#perConsumer = perConsumer;
    return perConsumer;
  }

  // The server samples the queues every 15 s and keeps a day, so the chart has the night's
  // history as soon as the page opens; a read also takes a fresh sample, so it moves live.
  async #loadDepths() {
    const report = await api("/api/v1/depths?window=" + (this.#windowIsDay() ? "24h" : "1h"));
    if (!report.queues) return;
    const q = report.queues;
    const xs = report.samples.map((s) => Date.parse(s.at) / 1000);
    const pick = (k) => report.samples.map((s) => s[k] ?? null);
    const to = Date.now() / 1000;
    $("depth-card").hidden = false;
    this.#charts.draw("depths", $("depth-chart"), [
      { label: `work ready (${q.work})`, stroke: "#1450a0" },
      { label: "work unacked", stroke: "#7a5cc0" },
      { label: `retry tiers (${q.retry.length})`, stroke: "#d08a00" },
      { label: `parking lot (${q.parking})`, stroke: "#c9302c" },
    ], [xs, pick("work"), pick("work_unacked"), pick("retry"), pick("parking")],
    [to - (this.#windowIsDay() ? 86400 : 3600), to]);
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

  async #loadFailures() {
    const groups = await api("/api/v1/failures");
    const { searchFor, openMessage, openBulk } = this.#links;
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
      const td = cell(tr, "");
      if (isParked(g.status)) {
        td.appendChild(action("bulk action", () => openBulk(
          { consumer: g.consumer, type: g.message_type, error_code: g.error_code || undefined },
          `the parked copies of consumer ${g.consumer}, type ${g.message_type}` +
            (g.error_code ? `, error code ${g.error_code}` : "") + ` (${g.rows} rows)`,
        ), "bulk"));
      }
    });
  }

  #consumerCard(consumer) {
    let card = this.#cards.get(consumer);
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
    this.#cards.set(consumer, card);
    return card;
  }

  async #loadActivity(perConsumer) {
    const query = this.#windowIsDay() ? "window=24h&bucket=15m" : "window=1h&bucket=1m";
    const report = await api("/api/v1/activity?" + query);
    for (const c of report.consumers) {
      const card = this.#consumerCard(c.consumer);
      const xs = c.buckets.map((b) => Date.parse(b.at) / 1000);
      const pick = (k) => c.buckets.map((b) => b[k]);
      const total = (k) => c.buckets.reduce((sum, b) => sum + (b[k] || 0), 0);
      const per = report.bucket_secs === 60 ? "per minute" : `per ${report.bucket_secs / 60} minutes`;
      this.#charts.draw(`activity:${c.consumer}`, card.activity, [
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
      this.#charts.draw(`latency:${c.consumer}`, card.latency, [
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

  async #loadAlerts() {
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
}
