// How the report of a redrive or discard (a preview or a run) is shown.

import { cell, el } from "./dom.js";

function counts(m) {
  return Object.entries(m).map(([k, v]) => `${k} ${v}`).join(", ") || "none";
}

/** One line: preview or done, what was examined, the classes found and the actions. */
export function reportSummary(report) {
  return (report.dry_run ? "Dry run: " : "Done: ") +
    `${report.examined} of ${report.parked_at_start} parked copies examined; ` +
    `classes: ${counts(report.classes)}; actions: ${counts(report.actions)}`;
}

/** A table of the report's findings, one row per copy, with the id `id`. */
export function findingsTable(report, id) {
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

/** Whether running the previewed action would change anything. */
export function wouldAct(report) {
  const a = report.actions;
  return (a.would_move || 0) + (a.would_remove || 0) + (a.would_discard || 0) > 0;
}
