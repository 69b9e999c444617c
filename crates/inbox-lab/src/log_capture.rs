//! Log output of a run whose terminal belongs to a progress line and a result table (the demo):
//! every event goes to a log file instead of stderr, and warnings and errors are counted by
//! reason so the run can end with a short summary and the file's path.

use std::{
    collections::HashMap,
    fmt::Debug,
    fs::File,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
};

use anyhow::Context;
use tracing::{
    Event, Level, Subscriber,
    field::{Field, Visit},
};
use tracing_subscriber::{
    EnvFilter, Layer, layer::Context as LayerContext, prelude::*, registry::Registry,
};

/// What a run logged at WARN or above, counted by reason.
#[derive(Clone)]
pub(crate) struct LogCapture {
    path: PathBuf,
    counts: Arc<Mutex<HashMap<Reason, u64>>>,
}

/// A warning's or error's reason: its level, its message and, if it has one, its `code` field
/// (the invalid-message code), without per-message details such as keys.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Reason {
    level: Level,
    message: String,
}

impl LogCapture {
    /// Installs the global subscriber: events at `filter` go to a new file at `path`
    /// (truncated), and warnings and errors are counted.
    pub(crate) fn install(path: &Path, filter: EnvFilter) -> anyhow::Result<Self> {
        let file =
            File::create(path).with_context(|| format!("creating log file {}", path.display()))?;
        let capture = Self {
            path: path.to_owned(),
            counts: Arc::default(),
        };
        let to_file = tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .with_writer(Mutex::new(file));
        Registry::default()
            .with(filter)
            .with(to_file)
            .with(capture.clone())
            .try_init()
            .context("installing the log subscriber")?;
        Ok(capture)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Lines for the end of a run: the number of warnings and errors, each reason with its
    /// count (most frequent first), and where the full log is.
    pub(crate) fn summary(&self) -> Vec<String> {
        let counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let total: u64 = counts.values().sum();
        let mut reasons: Vec<(&Reason, &u64)> = counts.iter().collect();
        reasons.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.message.cmp(&b.0.message)));
        let mut lines = vec![format!(
            "log: {} warning(s) and error(s), full log in {}",
            total,
            self.path.display()
        )];
        lines.extend(
            reasons.into_iter().map(|(reason, count)| {
                format!("{count:>8}  {:<5}  {}", reason.level, reason.message)
            }),
        );
        lines
    }
}

impl<S: Subscriber> Layer<S> for LogCapture {
    fn on_event(&self, event: &Event<'_>, _ctx: LayerContext<'_, S>) {
        let level = *event.metadata().level();
        if level > Level::WARN {
            return;
        }
        let mut fields = ReasonFields::default();
        event.record(&mut fields);
        let mut message = fields
            .message
            .unwrap_or_else(|| event.metadata().target().to_owned());
        if let Some(code) = fields.code {
            message = format!("{message} [{code}]");
        }
        *self
            .counts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(Reason { level, message })
            .or_default() += 1;
    }
}

/// The fields of an event that make its reason.
#[derive(Default)]
struct ReasonFields {
    message: Option<String>,
    code: Option<String>,
}

impl Visit for ReasonFields {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "message" => self.message = Some(value.to_owned()),
            "code" => self.code = Some(value.to_owned()),
            _ => {}
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        match field.name() {
            "message" => self.message = Some(format!("{value:?}")),
            "code" => self.code = Some(format!("{value:?}")),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warnings_are_counted_by_message_and_code_not_by_detail() {
        let capture = LogCapture {
            path: PathBuf::from("demo.log"),
            counts: Arc::default(),
        };
        let subscriber = Registry::default().with(capture.clone());
        tracing::subscriber::with_default(subscriber, || {
            for key in ["a", "b", "c"] {
                tracing::warn!(code = "invalid_json", inbox_key = key, "invalid message");
            }
            tracing::warn!(code = "missing_message_id", "invalid message");
            tracing::warn!(reason = "closed", "broker session lost; reconnecting");
            tracing::info!("not a warning");
        });
        assert_eq!(
            capture.summary(),
            [
                "log: 5 warning(s) and error(s), full log in demo.log",
                "       3  WARN   invalid message [invalid_json]",
                "       1  WARN   broker session lost; reconnecting",
                "       1  WARN   invalid message [missing_message_id]",
            ]
        );
    }
}
