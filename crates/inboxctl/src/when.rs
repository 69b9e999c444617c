//! Time arguments of the operations commands: durations (`90s`, `5m`, `1h 30m`) and instants
//! (RFC 3339, or a duration meaning that long ago).

use chrono::{DateTime, Utc};

/// A duration such as `90s`, `5m` or `2h`.
pub fn duration(text: &str) -> Result<std::time::Duration, String> {
    humantime::parse_duration(text).map_err(|e| format!("{e} (examples: 90s, 5m, 2h)"))
}

/// An instant: RFC 3339 (`2026-12-01T10:00:00Z`) or a duration ago (`2h` = two hours ago).
pub fn instant(text: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    let ago = duration(text).map_err(|_| {
        format!(
            "{text:?} is neither an RFC 3339 time (2026-12-01T10:00:00Z) nor a duration ago (2h)"
        )
    })?;
    let ago = chrono::Duration::from_std(ago).map_err(|e| e.to_string())?;
    Ok(Utc::now() - ago)
}

/// Retry tier delays.
#[derive(Clone, Debug)]
pub struct Delays(pub Vec<std::time::Duration>);

/// Retry tier delays, comma-separated (`1s,5s,30s`).
pub fn delays(text: &str) -> Result<Delays, String> {
    text.split(',')
        .map(|d| duration(d.trim()))
        .collect::<Result<_, _>>()
        .map(Delays)
}

/// A timestamp for a table cell.
pub fn cell(t: Option<DateTime<Utc>>) -> String {
    t.map(|t| t.format("%Y-%m-%d %H:%M:%S").to_string())
        .unwrap_or_default()
}

/// Seconds as a short human duration (`3m 12s`).
pub fn age(secs: Option<f64>) -> String {
    secs.map(|s| {
        let d = std::time::Duration::from_secs(s.max(0.0) as u64);
        humantime::format_duration(d).to_string()
    })
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instants_are_rfc3339_or_ago() {
        assert!(instant("2026-12-01T10:00:00Z").is_ok());
        let two_hours = instant("2h").expect("valid");
        assert!((Utc::now() - two_hours).num_minutes() >= 119);
        assert!(instant("yesterday-ish").is_err());
        assert_eq!(delays("1s, 5s").ok().map(|d| d.0.len()), Some(2));
    }
}
