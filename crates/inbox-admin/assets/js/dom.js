// Building the page's elements. Every value from the API is written with textContent, never
// parsed as HTML.

import { reporting } from "./page-error.js";

export const $ = (id) => document.getElementById(id);

export function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined && text !== null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

/** A link that runs `onClick`, its failure shown on the error line. */
export function action(text, onClick, cls) {
  const a = el("a", text, cls);
  a.addEventListener("click", () => reporting(onClick));
  return a;
}

/** Appends a cell with `text` to a table row. */
export function cell(row, text, cls) {
  const td = el("td", text === null || text === undefined ? "" : text, cls);
  row.appendChild(td);
  return td;
}

/** Appends a cell holding an action link to a table row. */
export function link(row, text, onClick, cls) {
  const td = cell(row, "");
  td.appendChild(action(text, onClick, cls));
  return td;
}

/** Replaces the body of the table `tableId` with one row per item, drawn by `render`. */
export function fill(tableId, items, render) {
  const body = $(tableId).querySelector("tbody");
  body.replaceChildren();
  for (const item of items) {
    const tr = document.createElement("tr");
    render(tr, item);
    body.appendChild(tr);
  }
}
