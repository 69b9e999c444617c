//! The bulk actions the console runs in the background (a redrive or a discard), with their
//! progress and outcome, and the server's list of recent ones.

use std::{
    collections::VecDeque,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use chrono::{DateTime, Utc};
use inbox_ops::{Progress, redrive::RedriveReport};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::error::ApiError;

/// A bulk action.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum JobAction {
    /// Move parked copies back to the work queue.
    Redrive,
    /// Remove parked copies of parked rows (rows kept).
    Discard,
}

/// When a job finished, and its report or why it failed.
type JobOutcome = (DateTime<Utc>, Result<RedriveReport, String>);

/// A bulk action running (or run) in the background.
pub(crate) struct Job {
    id: String,
    action: JobAction,
    actor: String,
    started_at: DateTime<Utc>,
    total: AtomicU64,
    done: AtomicU64,
    outcome: Mutex<Option<JobOutcome>>,
}

impl Progress for Job {
    fn set_total(&self, total: u64) {
        self.total.store(total, Ordering::Relaxed);
    }

    fn advance(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }
}

/// How a job looks to the caller.
#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct JobView {
    id: String,
    action: JobAction,
    /// The token's name the actions are audited under.
    actor: String,
    /// `running`, `done` or `failed`.
    state: &'static str,
    /// Parked copies to examine (known once the walk starts), and how many are done.
    total: u64,
    done: u64,
    started_at: DateTime<Utc>,
    finished_at: Option<DateTime<Utc>>,
    /// The action's report, once done.
    report: Option<RedriveReport>,
    /// Why it failed.
    error: Option<String>,
}

impl Job {
    /// A job of `action` by `actor`, starting now.
    pub(crate) fn start(id: String, action: JobAction, actor: String) -> Self {
        Self {
            id,
            action,
            actor,
            started_at: Utc::now(),
            total: AtomicU64::new(0),
            done: AtomicU64::new(0),
            outcome: Mutex::new(None),
        }
    }

    /// Records the job's outcome: it finished now.
    pub(crate) fn finish(&self, outcome: Result<RedriveReport, String>) {
        *self.outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some((Utc::now(), outcome));
    }

    pub(crate) fn view(&self) -> JobView {
        let outcome = self.outcome.lock().unwrap_or_else(|e| e.into_inner());
        let (state, finished_at, report, error) = match &*outcome {
            None => ("running", None, None, None),
            Some((at, Ok(report))) => ("done", Some(*at), Some(report.clone()), None),
            Some((at, Err(why))) => ("failed", Some(*at), None, Some(why.clone())),
        };
        JobView {
            id: self.id.clone(),
            action: self.action,
            actor: self.actor.clone(),
            state,
            total: self.total.load(Ordering::Relaxed),
            done: self.done.load(Ordering::Relaxed),
            started_at: self.started_at,
            finished_at,
            report,
            error,
        }
    }
}

/// The server's recent jobs: the running ones and the last finished ones.
#[derive(Default)]
pub(crate) struct Jobs(Mutex<VecDeque<Arc<Job>>>);

/// Most jobs kept; the oldest finished one goes first.
const KEPT_JOBS: usize = 100;

impl Jobs {
    pub(crate) fn add(&self, job: Arc<Job>) -> Result<(), ApiError> {
        let mut jobs = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if jobs.len() >= KEPT_JOBS {
            let finished = jobs.iter().position(|j| {
                j.outcome
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .is_some()
            });
            match finished {
                Some(i) => {
                    jobs.remove(i);
                }
                None => {
                    return Err(ApiError::too_many(
                        format!("{KEPT_JOBS} jobs are running; wait for one to finish"),
                        5,
                    ));
                }
            }
        }
        jobs.push_back(job);
        Ok(())
    }

    pub(crate) fn get(&self, id: &str) -> Option<Arc<Job>> {
        let jobs = self.0.lock().unwrap_or_else(|e| e.into_inner());
        jobs.iter().find(|j| j.id == id).cloned()
    }
}
