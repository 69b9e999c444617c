// The message search: a filter form, a page of matching rows at a time, and a bulk action on
// the page's parked rows.

import { api } from "./api.js";
import { $, cell, el, fill, link } from "./dom.js";
import { when } from "./format.js";
import { reporting } from "./page-error.js";
import { SEARCH_CHOICES, STATUSES, isParked } from "./statuses.js";

export class Search {
  #filter = null; // the filter of the page shown
  #links;

  /**
   * `links` leads elsewhere: `showView(name)`, `openMessage(consumer, id)` and
   * `openBulk(scope, label)`.
   */
  constructor(links) {
    this.#links = links;
    const status = $("q-status");
    status.replaceChildren(...SEARCH_CHOICES.map(([value, label]) => {
      const option = el("option", label);
      option.value = value;
      return option;
    }));
    $("search-form").addEventListener("submit", (e) => {
      e.preventDefault();
      reporting(() => this.#load(this.#formFilter()));
    });
  }

  /** Fills the form with `filter` and shows the first page of its matches. */
  searchFor(filter) {
    for (const input of this.#inputs()) {
      input.value = filter[input.name] || "";
    }
    location.hash = "messages";
    return this.#load(filter);
  }

  #inputs() {
    return $("search-form").querySelectorAll("input, select");
  }

  #formFilter() {
    const filter = {};
    for (const input of this.#inputs()) {
      if (input.value.trim()) filter[input.name] = input.value.trim();
    }
    // An id names one message whatever its state: look in every status, not only open rows.
    if (!filter.status && (filter.message_id || filter.correlation_id)) {
      filter.status = STATUSES.join(",");
    }
    return filter;
  }

  async #load(filter, cursor) {
    this.#filter = filter;
    const params = new URLSearchParams(filter);
    if (cursor) params.set("cursor", cursor);
    const page = await api("/api/v1/messages?" + params);
    const { showView, openMessage, openBulk } = this.#links;
    showView("messages");
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
    $("next-page").onclick = () => reporting(() => this.#load(this.#filter, page.next_cursor));
    const parked = page.rows.filter((r) => isParked(r.status));
    $("search-bulk").hidden = parked.length === 0;
    $("search-bulk").onclick = () => openBulk(
      { consumer: filter.consumer, message_ids: parked.map((r) => r.message_id) },
      `${parked.length} parked message(s) of this page: ` +
        parked.slice(0, 5).map((r) => r.message_id).join(", ") + (parked.length > 5 ? ", ..." : ""),
    );
  }
}
