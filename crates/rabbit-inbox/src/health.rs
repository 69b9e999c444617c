//! [`Health`]: what a liveness or readiness probe asks of a running consumer and the tasks
//! beside it.
//!
//! The consumer writes its broker session's state (connected, consuming, the last session
//! error and when) and a [`crate::Runner`] given the handle writes which of its tasks still run
//! and how the others ended. Reading is a [`HealthSnapshot`], serializable for a probe's body.
//!
//! The rules:
//! - **live** ([`HealthSnapshot::live`]): every task still runs. A consumer riding out a broker
//!   or database outage is live: a restart would not bring the broker back. A task that ended
//!   (which stops the whole run, see [`crate::Runner`]) is not.
//! - **ready** ([`HealthSnapshot::ready`]): live, not stopping, and the consumer is connected
//!   to the broker and consuming its queue. Not ready from start-up until the first session
//!   consumes, while a lost session is being reopened, and from shutdown on.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::watch;

/// A cloneable handle on a consumer's health: the consumer writes it, probes read it. Get it
/// before `run` ([`crate::Consumer::health`]); it stays readable after the run ends.
#[derive(Clone, Debug)]
pub struct Health(Arc<watch::Sender<HealthSnapshot>>);

/// A failure that ended a broker session (or kept one from opening), and when.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SessionError {
    /// What happened, as the consumer logged it.
    pub error: String,
    /// When.
    pub at: DateTime<Utc>,
}

/// How a task run beside the consumer stands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct TaskHealth {
    /// The name the task runs under.
    pub name: String,
    /// Whether it still runs.
    pub running: bool,
    /// When it ended; `None` while it runs.
    pub ended_at: Option<DateTime<Utc>>,
    /// The error it ended with; `None` if it runs or ended without one.
    pub error: Option<String>,
}

/// The health of a consumer and its tasks at one moment. Serializes as JSON for a probe's
/// body, `live` and `ready` included.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct HealthSnapshot {
    /// A broker session is open.
    pub connected: bool,
    /// The session consumes the work queue (false while it drains at shutdown).
    pub consuming: bool,
    /// When the current session began consuming.
    pub consuming_since: Option<DateTime<Utc>>,
    /// Broker sessions opened so far.
    pub sessions: u64,
    /// The last failure of a broker session, kept after a new session opens.
    pub last_session_error: Option<SessionError>,
    /// The run was told to stop.
    pub stopping: bool,
    /// The tasks of the runner given this handle, in the order they were added.
    pub tasks: Vec<TaskHealth>,
    /// See the module's rules.
    pub live: bool,
    /// See the module's rules.
    pub ready: bool,
}

impl HealthSnapshot {
    fn settle(&mut self) {
        self.live = self.tasks.iter().all(|t| t.running);
        self.ready = self.live && !self.stopping && self.connected && self.consuming;
    }

    /// The tasks that ended, with how.
    pub fn ended_tasks(&self) -> impl Iterator<Item = &TaskHealth> {
        self.tasks.iter().filter(|t| !t.running)
    }
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

impl Health {
    /// A handle for a consumer that has not connected yet: live, not ready.
    pub fn new() -> Self {
        let mut initial = HealthSnapshot::default();
        initial.settle();
        Self(Arc::new(watch::Sender::new(initial)))
    }

    /// The state now.
    pub fn snapshot(&self) -> HealthSnapshot {
        self.0.borrow().clone()
    }

    /// Whether a liveness probe should pass (see the module's rules).
    pub fn is_live(&self) -> bool {
        self.0.borrow().live
    }

    /// Whether a readiness probe should pass (see the module's rules).
    pub fn is_ready(&self) -> bool {
        self.0.borrow().ready
    }

    /// Waits until `check` holds for the state, and returns that state.
    pub async fn wait_for(&self, mut check: impl FnMut(&HealthSnapshot) -> bool) -> HealthSnapshot {
        let mut changes = self.0.subscribe();
        match changes.wait_for(|s| check(s)).await {
            Ok(state) => state.clone(),
            // The sender lives as long as `self`: not reached.
            Err(_) => self.snapshot(),
        }
    }

    fn update(&self, change: impl FnOnce(&mut HealthSnapshot)) {
        self.0.send_modify(|s| {
            change(s);
            s.settle();
        });
    }

    /// A broker session opened and consumes.
    pub(crate) fn consuming(&self) {
        self.update(|s| {
            s.connected = true;
            s.consuming = true;
            s.consuming_since = Some(Utc::now());
            s.sessions += 1;
        });
    }

    /// The session stopped consuming (shutdown): it drains, still connected.
    pub(crate) fn draining(&self) {
        self.update(|s| {
            s.consuming = false;
            s.consuming_since = None;
            s.stopping = true;
        });
    }

    /// The session is gone: lost with `error`, or closed (`None`).
    pub(crate) fn disconnected(&self, error: Option<String>) {
        self.update(|s| {
            s.connected = false;
            s.consuming = false;
            s.consuming_since = None;
            if let Some(error) = error {
                s.last_session_error = Some(SessionError {
                    error,
                    at: Utc::now(),
                });
            }
        });
    }

    /// The run was told to stop.
    pub(crate) fn stopping(&self) {
        self.update(|s| s.stopping = true);
    }

    /// A task named `name` runs.
    pub(crate) fn task_started(&self, name: &str) {
        self.update(|s| {
            s.tasks.push(TaskHealth {
                name: name.to_owned(),
                running: true,
                ended_at: None,
                error: None,
            });
        });
    }

    /// The task named `name` ended, with `error` or without.
    pub(crate) fn task_ended(&self, name: &str, error: Option<String>) {
        self.update(|s| {
            if let Some(task) = s.tasks.iter_mut().find(|t| t.name == name && t.running) {
                task.running = false;
                task.ended_at = Some(Utc::now());
                task.error = error;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_needs_a_consuming_session_and_every_task_running() {
        let health = Health::new();
        assert!(
            health.is_live() && !health.is_ready(),
            "{:?}",
            health.snapshot()
        );
        health.task_started("consumer");
        health.task_started("relay");
        health.consuming();
        assert!(health.is_ready());
        health.disconnected(Some("connection reset".into()));
        let s = health.snapshot();
        assert!(s.live && !s.ready && !s.connected);
        assert_eq!(
            s.last_session_error.as_ref().map(|e| e.error.as_str()),
            Some("connection reset")
        );
        health.consuming();
        assert!(health.is_ready(), "the last error stays, readiness returns");
        assert!(health.snapshot().last_session_error.is_some());
        health.task_ended("relay", Some("bad config".into()));
        let s = health.snapshot();
        assert!(!s.live && !s.ready);
        let ended: Vec<_> = s.ended_tasks().map(|t| t.name.as_str()).collect();
        assert_eq!(ended, ["relay"]);
        let json = serde_json::to_value(&s).expect("serializes");
        assert_eq!(json["tasks"][1]["error"], "bad config");
        assert_eq!(json["ready"], false);
    }

    #[test]
    fn stopping_is_not_ready() {
        let health = Health::new();
        health.consuming();
        health.stopping();
        assert!(health.is_live() && !health.is_ready());
    }
}
