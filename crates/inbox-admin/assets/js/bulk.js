// Bulk actions: a redrive or discard of a failure group or of a search page's parked rows,
// previewed first, then run as a job on the server with a progress bar, and the run's audit
// trail.

import { api } from "./api.js";
import { $, cell, el, link } from "./dom.js";
import { when } from "./format.js";
import { reporting, showError } from "./page-error.js";
import { findingsTable, reportSummary, wouldAct } from "./redrive-report.js";

const POLL_MS = 250;

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

function showReport(report) {
  const out = $("bulk-result");
  const summary = el("p", reportSummary(report));
  summary.id = "bulk-summary";
  out.replaceChildren(summary);
  if (report.findings.length) out.appendChild(findingsTable(report, "bulk-findings"));
}

export class Bulk {
  #scope = null; // what the action applies to: a consumer, type and error code, or ids
  #links;

  /**
   * `links` leads elsewhere: `showView(name)`, `openMessage(consumer, id)`, and
   * `afterRun()`, awaited once a job ran.
   */
  constructor(links) {
    this.#links = links;
    $("bulk-preview").addEventListener("click", () => reporting(() => this.#preview()));
    $("bulk-run").addEventListener("click", () => reporting(() => this.#run()));
    $("bulk-action").addEventListener("change", () => {
      $("bulk-run").disabled = true;
      $("bulk-result").replaceChildren();
    });
  }

  /** Offers an action on `scope`, described to the operator as `label`. */
  open(scope, label) {
    this.#scope = scope;
    location.hash = "messages";
    this.#links.showView("messages");
    $("bulk-section").hidden = false;
    $("detail-section").hidden = true;
    $("bulk-scope").textContent = "Applies to " + label + ".";
    $("bulk-result").replaceChildren();
    $("bulk-run").disabled = true;
    $("bulk-progress").hidden = true;
    $("bulk-section").scrollIntoView();
  }

  #body(dryRun) {
    const scope = this.#scope;
    return {
      dry_run: dryRun,
      reason: $("bulk-reason").value,
      ticket: $("bulk-ticket").value || undefined,
      consumer: scope.consumer || undefined,
      type: scope.type || undefined,
      error_code: scope.error_code || undefined,
      message_ids: scope.message_ids || undefined,
    };
  }

  async #preview() {
    showError(null);
    const report = await api("/api/v1/" + $("bulk-action").value, {
      method: "POST", body: this.#body(true),
    });
    showReport(report);
    $("bulk-run").disabled = !wouldAct(report);
  }

  async #run() {
    showError(null);
    $("bulk-run").disabled = true;
    const started = await api("/api/v1/jobs", {
      method: "POST",
      body: { action: $("bulk-action").value, ...this.#body(false) },
    });
    const progress = $("bulk-progress");
    progress.hidden = false;
    progress.removeAttribute("value");
    let job = started;
    while (job.state === "running") {
      await sleep(POLL_MS);
      job = await api("/api/v1/jobs/" + encodeURIComponent(started.id));
      if (job.total) {
        progress.max = job.total;
        progress.value = job.done;
      }
    }
    progress.hidden = true;
    if (job.state === "failed") throw new Error(job.error);
    showReport(job.report);
    await this.#showAudit(job);
    await this.#links.afterRun();
  }

  // This job's rows only: each carries the job's id (the actor and start time narrow the read).
  async #showAudit(job) {
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
        link(tr, a.message_id, () => this.#links.openMessage(a.consumer_name, a.message_id));
      } else {
        cell(tr, a.message_id || "");
      }
      cell(tr, a.reason);
      cell(tr, a.ticket || "");
      table.appendChild(tr);
    }
    $("bulk-result").append(title, table);
  }
}
