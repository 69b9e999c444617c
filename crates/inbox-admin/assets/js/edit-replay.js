// The message view's edit and replay: a parked message's body edited, its diff previewed,
// and replayed as a new message.

import { api, messagePath } from "./api.js";
import { $, action, el } from "./dom.js";
import { reporting, showError } from "./page-error.js";

export class EditReplay {
  #row = null; // the message edited
  #openMessage;

  /** `openMessage(consumer, id)` opens the replacement. */
  constructor(openMessage) {
    this.#openMessage = openMessage;
    $("edit-preview").addEventListener("click", () => reporting(() => this.#replay(true)));
    $("edit-run").addEventListener("click", () => reporting(() => this.#replay(false)));
    $("edit-body").addEventListener("input", () => {
      $("edit-run").disabled = true;
    });
  }

  /** Offers `row`'s body (text, or null when not readable) for editing, or hides the editor. */
  show(row, editable, body) {
    this.#row = row;
    $("edit-section").hidden = !(editable && body !== null);
    if (!$("edit-section").hidden) {
      let text = body;
      try {
        text = JSON.stringify(JSON.parse(body), null, 2);
      } catch (_) {
        // Not JSON: edited as text.
      }
      $("edit-body").value = text;
    }
    $("edit-diff").replaceChildren();
    $("edit-result").textContent = "";
    $("edit-run").disabled = true;
  }

  async #replay(dryRun) {
    showError(null);
    const row = this.#row;
    if (!row) return;
    const path = messagePath(row.consumer_name, row.message_id) + "/replay-edited";
    const report = await api(path, {
      method: "POST",
      body: {
        body: $("edit-body").value,
        dry_run: dryRun,
        reason: $("edit-reason").value,
        ticket: $("edit-ticket").value || undefined,
      },
    });
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
      ), action("Open the replacement",
        () => this.#openMessage(report.consumer, report.replacement_id), "replacement"));
      result.dataset.replacement = report.replacement_id;
      $("edit-run").disabled = true;
    }
  }
}
