// The JSON API client, with the bearer token the operator entered: kept in this tab's
// sessionStorage, never in the page.

const TOKEN_KEY = "inbox-admin-token";

function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function useToken(value) {
  sessionStorage.setItem(TOKEN_KEY, value);
}

export function forgetToken() {
  sessionStorage.removeItem(TOKEN_KEY);
}

/** Calls the API; resolves to its JSON answer, or rejects with the status and its error. */
export async function api(path, options = {}) {
  const headers = { Accept: "application/json" };
  if (token()) headers.Authorization = "Bearer " + token();
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method: options.method || "GET",
    headers,
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  const data = await response.json().catch(() => ({}));
  if (!response.ok) {
    throw new Error(`${response.status}: ${data.error || response.statusText}`);
  }
  return data;
}

/** The path of one message's endpoints. */
export function messagePath(consumer, id) {
  return `/api/v1/messages/${encodeURIComponent(consumer)}/${encodeURIComponent(id)}`;
}
