// The message view's redrive of its failure group: the parked copies of the message's
// consumer, type and error code, previewed first.

import { api } from "./api.js";
import { $, el } from "./dom.js";
import { reporting, showError } from "./page-error.js";
import { findingsTable, reportSummary, wouldAct } from "./redrive-report.js";

export class GroupRedrive {
  #row = null; // the message whose group is redriven
  #afterRun;

  /** `afterRun()` is awaited once a redrive ran (not after a preview). */
  constructor(afterRun) {
    this.#afterRun = afterRun;
    $("redrive-preview").addEventListener("click", () => reporting(() => this.#redrive(true)));
    $("redrive-run").addEventListener("click", () => reporting(() => this.#redrive(false)));
  }

  /** Offers the redrive of `row`'s group, or hides it (`parked` false). */
  show(row, parked) {
    this.#row = row;
    $("actions").hidden = !parked;
    $("redrive-result").replaceChildren();
    $("redrive-run").disabled = true;
  }

  async #redrive(dryRun) {
    showError(null);
    const row = this.#row;
    if (!row) return;
    const report = await api("/api/v1/redrive", {
      method: "POST",
      body: {
        dry_run: dryRun,
        reason: $("reason").value,
        consumer: row.consumer_name,
        type: row.message_type,
        error_code: row.last_error_code || undefined,
      },
    });
    const out = $("redrive-result");
    const summary = el("p", reportSummary(report));
    summary.id = "redrive-summary";
    out.replaceChildren(summary);
    if (report.findings.length) out.appendChild(findingsTable(report, "redrive-findings"));
    $("redrive-run").disabled = !dryRun || !wouldAct(report);
    if (!dryRun) await this.#afterRun();
  }
}
