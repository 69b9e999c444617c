// Blocked keys of an ordered consumer: the keys whose held messages wait behind a failed or
// parked head (or for a missing sequence number), and skipping what one of them waits for,
// with a reason and a ticket (audited under the token's name).

import { api } from "./api.js";
import { $, cell, el, fill, link } from "./dom.js";
import { age, when } from "./format.js";
import { reporting, showError } from "./page-error.js";

const LIMIT = 200;

function keysPath(consumer) {
  return `/api/v1/consumers/${encodeURIComponent(consumer)}/blocked-keys`;
}

export class BlockedKeys {
  #consumer = ""; // the consumer whose keys are shown
  #key = null; // the key whose skip is being asked for
  #links;

  /** `links` leads elsewhere: `openMessage(consumer, id)`. */
  constructor(links) {
    this.#links = links;
    $("blocked-form").addEventListener("submit", (e) => {
      e.preventDefault();
      reporting(() => this.#load($("blocked-consumer").value.trim()));
    });
    $("skip-run").addEventListener("click", () => reporting(() => this.#skip()));
    $("skip-cancel").addEventListener("click", () => this.#closeSkip());
  }

  /**
   * Called when the view is shown, for `consumer` if given: offers the consumers the inbox
   * knows, and shows the keys of the one asked for (else the one shown, else the first).
   */
  async shown(consumer) {
    const report = await api("/api/v1/status");
    const consumers = [...new Set(report.lines.map((l) => l.consumer))].sort();
    $("blocked-consumers").replaceChildren(...consumers.map((c) => {
      const option = el("option");
      option.value = c;
      return option;
    }));
    const chosen = consumer || this.#consumer || consumers[0] || "";
    $("blocked-consumer").value = chosen;
    if (chosen) await this.#load(chosen);
  }

  async #load(consumer) {
    showError(null);
    this.#consumer = consumer;
    this.#closeSkip();
    const keys = await api(`${keysPath(consumer)}?limit=${LIMIT}`);
    $("blocked-summary").textContent = keys.length
      ? `${keys.length} key(s) of ${consumer} wait, oldest first` +
        (keys.length === LIMIT ? ` (the first ${LIMIT})` : "")
      : `No key of ${consumer} is blocked or waits on a sequence gap.`;
    fill("blocked-keys", keys, (tr, k) => {
      tr.dataset.key = k.order_key;
      cell(tr, k.order_key, "key");
      cell(tr, k.reason === "head" ? "head" : "sequence gap", "reason");
      if (k.head_message_id) {
        link(tr, k.head_message_id, () => this.#links.openMessage(consumer, k.head_message_id),
          "head");
      } else {
        cell(tr, "");
      }
      cell(tr, k.head_status || "");
      const error = cell(tr, k.head_error_code || "");
      if (k.head_error) error.appendChild(el("div", k.head_error, "muted"));
      cell(tr, age(k.age_seconds), "num").title = when(k.blocked_since);
      cell(tr, k.held, "num held");
      cell(tr, k.next_sequence === null ? "" : `${k.next_sequence} / ${k.first_held_position}`,
        "num");
      link(tr, k.reason === "head" ? "Skip head" : "Skip gap", () => this.#openSkip(k), "skip");
    });
  }

  #openSkip(k) {
    this.#key = k;
    $("skip-what").textContent = k.reason === "head"
      ? `the head ${k.head_message_id} of ${k.order_key}`
      : `the sequence gap of ${k.order_key}`;
    $("skip-explain").textContent = k.reason === "head"
      ? `The key's ${k.held} held message(s) go on without ${k.head_message_id}, released in ` +
        "order. The head itself stays as it is (" + (k.head_status || "gone") + "): redrive " +
        "or replay it later if it should still apply."
      : `The key stops waiting for sequence number ${k.next_sequence} and goes on from ` +
        `${k.first_held_position}, its first held one; a missing message that arrives later ` +
        "is parked as passed.";
    $("skip-result").textContent = "";
    $("skip-panel").hidden = false;
    $("skip-reason").focus();
  }

  #closeSkip() {
    this.#key = null;
    $("skip-panel").hidden = true;
  }

  async #skip() {
    showError(null);
    const k = this.#key;
    if (!k) return;
    const done = await api(`${keysPath(this.#consumer)}/skip`, {
      method: "POST",
      body: {
        order_key: k.order_key,
        expected_head: k.head_message_id || undefined,
        reason: $("skip-reason").value,
        ticket: $("skip-ticket").value || undefined,
      },
    });
    const skipped = done.skipped === "head" ? `head ${done.head_message_id}` : "sequence gap";
    const result = $("skip-result");
    result.textContent = `Skipped the ${skipped} of ${done.order_key} ` +
      `(audit #${done.audit_id}): ${done.to_release} of ${done.held} held message(s) go on` +
      (done.to_release < done.held
        ? `; the rest wait for sequence number ${done.next_sequence_after}` : "") + ".";
    result.dataset.audit = done.audit_id;
    $("skip-reason").value = "";
    $("skip-ticket").value = "";
    await this.#load(this.#consumer);
  }
}
