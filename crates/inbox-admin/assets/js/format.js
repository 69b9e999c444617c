// How ages and instants are written.

/** An age in seconds, rounded to the unit that reads best ("-" when unknown). */
export function age(secs) {
  if (secs === null || secs === undefined) return "-";
  const s = Math.round(secs);
  if (s < 120) return s + "s";
  if (s < 7200) return Math.round(s / 60) + "m";
  if (s < 172800) return Math.round(s / 3600) + "h";
  return Math.round(s / 86400) + "d";
}

/** An instant in UTC to the second ("" when absent). */
export function when(t) {
  return t ? new Date(t).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z") : "";
}
