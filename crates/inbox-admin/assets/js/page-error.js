// The page's error line: what the last failed call or action said.

/** Shows `e`'s message, or hides the line when `e` is null. */
export function showError(e) {
  const line = document.getElementById("error");
  line.textContent = e ? String(e.message || e) : "";
  line.hidden = !e;
}

/** Runs `run`, its failure shown on the error line. */
export function reporting(run) {
  return Promise.resolve().then(run).catch(showError);
}
