// The console's entry: builds the views, switches between them by the page's hash
// (#overview, #messages, #message/<consumer>/<id>, #blocked, #blocked/<consumer>), and takes
// the operator's token. Each
// view keeps its own state; they reach one another only through the links given here.

import { forgetToken, useToken } from "./api.js";
import { BlockedKeys } from "./blocked.js";
import { Bulk } from "./bulk.js";
import { $ } from "./dom.js";
import { MessageView } from "./message.js";
import { Overview } from "./overview.js";
import { reporting } from "./page-error.js";
import { Search } from "./search.js";

/**
 * Shows the overview, the blocked keys, or the messages' sections (search, and a message or a
 * bulk action).
 */
function showView(view) {
  const overview = view === "overview";
  const blocked = view === "blocked";
  const messages = !overview && !blocked;
  $("overview-section").hidden = !overview;
  $("blocked-section").hidden = !blocked;
  $("search-section").hidden = !messages;
  if (!messages) {
    $("detail-section").hidden = true;
    $("bulk-section").hidden = true;
  }
  $("nav-overview").classList.toggle("current", overview);
  $("nav-blocked").classList.toggle("current", blocked);
  $("nav-messages").classList.toggle("current", messages);
  if (overview) views.overview.shown();
}

function messageHash(consumer, id) {
  return `#message/${encodeURIComponent(consumer)}/${encodeURIComponent(id)}`;
}

/** Opens a message through the hash, so that the browser's history has it. */
function openMessage(consumer, id) {
  const hash = messageHash(consumer, id);
  if (location.hash === hash) return views.message.show(consumer, id);
  location.hash = hash; // route() shows it
  return Promise.resolve();
}

function route() {
  const hash = decodeURIComponent(location.hash.slice(1));
  if (hash.startsWith("message/")) {
    const [, consumer, ...id] = hash.split("/");
    showView("messages");
    return views.message.show(consumer, id.join("/"));
  }
  if (hash === "blocked" || hash.startsWith("blocked/")) {
    showView("blocked");
    return views.blocked.shown(hash.slice("blocked/".length));
  }
  showView(hash === "messages" ? "messages" : "overview");
  return Promise.resolve();
}

const refresh = () => views.overview.refresh();
const openBulk = (scope, label) => views.bulk.open(scope, label);
const views = Object.freeze({
  overview: new Overview({
    searchFor: (filter) => views.search.searchFor(filter),
    openMessage,
    openBulk,
  }),
  search: new Search({ showView, openMessage, openBulk }),
  message: new MessageView(openMessage, refresh),
  bulk: new Bulk({ showView, openMessage, afterRun: refresh }),
  blocked: new BlockedKeys({ openMessage }),
});

$("token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  useToken($("token").value);
  $("token").value = "";
  reporting(() => refresh().then(route));
});
$("token-clear").addEventListener("click", () => {
  forgetToken();
  reporting(refresh);
});
window.addEventListener("hashchange", () => reporting(route));
reporting(refresh);
reporting(route);
