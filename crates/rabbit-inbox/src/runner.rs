//! [`Runner`]: a consumer and its background work side by side under one shutdown.
//!
//! The consumer runtime knows nothing of the work that runs beside it: the outbox relay
//! ([`crate::Relay`]), the gauges' sampler ([`crate::InboxSampler`]), the operator crate's
//! retention and recovery timers. Each is a peer with the same shape, `run(self, shutdown)`,
//! and a runner starts them together, stops them together, and says which one failed.

use std::{
    collections::HashMap,
    fmt,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use futures::future::BoxFuture;
use tokio::task::JoinSet;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::health::Health;

/// The error a task ends with, whatever its own type.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The shutdown future a [`Runner`] hands each task: completes when the run stops.
pub struct Shutdown(Pin<Box<WaitForCancellationFutureOwned>>);

impl fmt::Debug for Shutdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Shutdown")
    }
}

impl Future for Shutdown {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.0.as_mut().poll(cx)
    }
}

/// What a task of a [`Runner`] ends with: `()` for a task that cannot fail (nothing ends it
/// but shutdown), or a `Result` whose error ends the run.
pub trait TaskResult: Send + 'static {
    /// The result as the runner reports it.
    fn into_task_result(self) -> Result<(), Box<dyn std::error::Error + Send + Sync>>;
}

impl TaskResult for () {
    fn into_task_result(self) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        Ok(())
    }
}

impl<E> TaskResult for Result<(), E>
where
    E: Into<Box<dyn std::error::Error + Send + Sync>> + Send + 'static,
{
    fn into_task_result(self) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.map_err(Into::into)
    }
}

/// Why a [`Runner`]'s run ended with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// A task ended with an error, or panicked; the others were stopped.
    #[error("{task} stopped: {source}")]
    TaskFailed {
        /// The name the task was added under.
        task: String,
        /// Why it stopped.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Tasks were still running when the shutdown timeout expired, and were abandoned. A
    /// consumer among them leaves its unsettled deliveries to the broker, which requeues them
    /// when the connection closes (at the latest when the process exits); those whose
    /// transaction committed are recognised by the inbox when they come back.
    #[error(
        "{} did not stop within the shutdown timeout ({timeout:?}) and were abandoned; their \
         unsettled deliveries return to the queue when the process exits. Look for what blocks \
         them (a handler that does not return, a database or broker that does not answer), or \
         allow a longer shutdown timeout",
        unfinished.join(", ")
    )]
    ShutdownTimedOut {
        /// The timeout that expired.
        timeout: Duration,
        /// The tasks that had not finished, in the order they were added.
        unfinished: Vec<String>,
    },
}

impl RunError {
    /// The tasks the error is about: the one that failed, or those that did not stop in time.
    pub fn tasks(&self) -> Vec<&str> {
        match self {
            Self::TaskFailed { task, .. } => vec![task.as_str()],
            Self::ShutdownTimedOut { unfinished, .. } => {
                unfinished.iter().map(String::as_str).collect()
            }
        }
    }
}

/// Runs tasks side by side until a shutdown future completes or one of them ends.
///
/// ```no_run
/// # async fn run(consumer: rabbit_inbox::Consumer<()>, relay: rabbit_inbox::Relay,
/// #     sampler: rabbit_inbox::InboxSampler) -> Result<(), rabbit_inbox::RunError> {
/// use std::time::Duration;
///
/// use rabbit_inbox::{Runner, shutdown_signal};
///
/// Runner::new()
///     .task("consumer", |stop| consumer.run(stop))
///     .task("relay", |stop| relay.run(stop))
///     .task("sampler", |stop| sampler.run(stop))
///     .shutdown_timeout(Duration::from_secs(20))
///     .run(shutdown_signal())
///     .await
/// # }
/// ```
///
/// When `shutdown` completes, every task is told to stop (each drains as its own `run`
/// documents) and the run returns once all have, or once the [shutdown
/// timeout](Self::shutdown_timeout) expires. A task that ends by itself, with an error or
/// without, stops the others too: a consumer whose relay has given up on its configuration
/// should not go on filling an outbox nobody empties, and a process supervisor restarts the
/// whole. The first error is returned; later ones are logged.
#[must_use = "a runner does nothing until `run` is awaited"]
pub struct Runner {
    stop: CancellationToken,
    tasks: Vec<(String, BoxFuture<'static, Result<(), BoxError>>)>,
    shutdown_timeout: Option<Duration>,
    health: Option<Health>,
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field(
                "tasks",
                &self.tasks.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field("shutdown_timeout", &self.shutdown_timeout)
            .finish_non_exhaustive()
    }
}

impl Default for Runner {
    fn default() -> Self {
        Self::new()
    }
}

impl Runner {
    /// A runner with no tasks, which waits for its tasks to stop as long as they take.
    pub fn new() -> Self {
        Self {
            stop: CancellationToken::new(),
            tasks: Vec::new(),
            shutdown_timeout: None,
            health: None,
        }
    }

    /// Adds the task `start` returns when given the run's [`Shutdown`]; `name` is how logs,
    /// a [`RunError`] and [`Health`] refer to it. The task ends with `()` if it cannot fail,
    /// else with a `Result` ([`TaskResult`]).
    pub fn task<F, Fut>(mut self, name: impl Into<String>, start: F) -> Self
    where
        F: FnOnce(Shutdown) -> Fut,
        Fut: Future + Send + 'static,
        Fut::Output: TaskResult,
    {
        let task = start(Shutdown(Box::pin(self.stop.clone().cancelled_owned())));
        self.tasks.push((
            name.into(),
            Box::pin(async move { task.await.into_task_result() }),
        ));
        self
    }

    /// After the run is told to stop, gives the tasks at most `timeout` to finish; past it the
    /// run abandons those still running and returns [`RunError::ShutdownTimedOut`] naming
    /// them. Keep it below the supervisor's own grace period (Kubernetes: 30 s by default),
    /// so that the error is logged before the process is killed.
    pub fn shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = Some(timeout);
        self
    }

    /// Writes which tasks run, and how those that ended did, to `health` (usually the
    /// consumer's, [`crate::Consumer::health`]), and that the run stops.
    pub fn with_health(mut self, health: Health) -> Self {
        self.health = Some(health);
        self
    }

    /// Runs every task until `shutdown` completes or one of them ends, then stops the others
    /// and waits for them, at most the shutdown timeout.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
        let mut running = JoinSet::new();
        let mut names = HashMap::new();
        let mut order = Vec::with_capacity(self.tasks.len());
        for (name, task) in self.tasks {
            if let Some(health) = &self.health {
                health.task_started(&name);
            }
            let id = running.spawn(task).id();
            order.push(id);
            names.insert(id, name);
        }
        let mut ended = Ended {
            names,
            health: self.health.clone(),
            first_error: None,
        };
        let mut shutdown = std::pin::pin!(shutdown);
        tokio::select! {
            () = &mut shutdown => {}
            Some(result) = running.join_next_with_id() => ended.note(result, true),
        }
        if let Some(health) = &self.health {
            health.stopping();
        }
        self.stop.cancel();
        let drain = async {
            while let Some(result) = running.join_next_with_id().await {
                ended.note(result, false);
            }
        };
        let timed_out = match self.shutdown_timeout {
            None => {
                drain.await;
                None
            }
            Some(timeout) => tokio::time::timeout(timeout, drain)
                .await
                .err()
                .map(|_| timeout),
        };
        if let Some(timeout) = timed_out {
            // Dropping the set aborts them; not awaited: one stuck outside an await would
            // hold the run forever.
            running.abort_all();
            let unfinished: Vec<String> = order
                .iter()
                .filter_map(|id| ended.names.get(id).cloned())
                .collect();
            for task in &unfinished {
                if let Some(health) = &ended.health {
                    health.task_ended(
                        task,
                        Some("did not stop within the shutdown timeout".into()),
                    );
                }
            }
            let error = RunError::ShutdownTimedOut {
                timeout,
                unfinished,
            };
            tracing::error!(%error, "shutdown timed out");
            // The first failure is the cause; the timeout follows from the run's stopping.
            return Err(ended.first_error.unwrap_or(error));
        }
        ended.first_error.map_or(Ok(()), Err)
    }
}

/// The tasks still running (by id) and how the others ended.
struct Ended {
    names: HashMap<tokio::task::Id, String>,
    health: Option<Health>,
    first_error: Option<RunError>,
}

impl Ended {
    /// Records how a task ended.
    fn note(
        &mut self,
        ended: Result<(tokio::task::Id, Result<(), BoxError>), tokio::task::JoinError>,
        before_shutdown: bool,
    ) {
        let (id, result) = match ended {
            Ok((id, result)) => (id, result),
            Err(e) => (e.id(), Err(format!("the task failed: {e}").into())),
        };
        let task = self.names.remove(&id).unwrap_or_default();
        if let Some(health) = &self.health {
            let error = result.as_ref().err().map(ToString::to_string);
            let error = error.or_else(|| {
                before_shutdown.then(|| "ended before shutdown (without an error)".to_owned())
            });
            health.task_ended(&task, error);
        }
        match result {
            Ok(()) if before_shutdown => {
                tracing::warn!(%task, "task ended before shutdown; stopping the others");
            }
            Ok(()) => {}
            Err(source) if self.first_error.is_none() => {
                tracing::error!(%task, error = %source, "task stopped; stopping the others");
                self.first_error = Some(RunError::TaskFailed { task, source });
            }
            Err(source) => tracing::error!(%task, error = %source, "task stopped"),
        }
    }
}

/// Completes on SIGINT (Ctrl-C) or SIGTERM: the usual shutdown future for
/// [`Runner::run`] and [`crate::Consumer::run`].
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
                return;
            }
            Err(e) => tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops"),
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn shutdown_stops_every_task_and_a_failing_task_stops_the_rest() {
        let stopped = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let waiter = |stopped: std::sync::Arc<std::sync::atomic::AtomicUsize>| {
            move |stop: Shutdown| async move {
                stop.await;
                stopped.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok::<(), std::io::Error>(())
            }
        };
        Runner::new()
            .task("a", waiter(stopped.clone()))
            .task("b", waiter(stopped.clone()))
            .run(tokio::time::sleep(Duration::from_millis(10)))
            .await
            .expect("clean shutdown");
        assert_eq!(stopped.load(std::sync::atomic::Ordering::SeqCst), 2);

        let err = Runner::new()
            .task("waits", waiter(stopped.clone()))
            .task("fails", |_stop| async {
                Err::<(), _>(std::io::Error::other("no queue"))
            })
            .run(std::future::pending())
            .await
            .expect_err("the failing task ends the run");
        assert_eq!(err.tasks(), ["fails"]);
        assert_eq!(err.to_string(), "fails stopped: no queue");
        assert_eq!(stopped.load(std::sync::atomic::Ordering::SeqCst), 3);

        let err = Runner::new()
            .task("panics", |_stop| async {
                panic!("bug");
                #[allow(unreachable_code)]
                Ok::<(), std::io::Error>(())
            })
            .run(std::future::pending())
            .await
            .expect_err("a panic is an error");
        assert_eq!(err.tasks(), ["panics"]);
    }

    #[tokio::test]
    async fn infallible_tasks_run_beside_fallible_ones() {
        Runner::new()
            .task("cannot fail", |stop| stop)
            .task("infallible", |stop| async move {
                stop.await;
                Ok::<(), std::convert::Infallible>(())
            })
            .task("may fail", |stop| async move {
                stop.await;
                Ok::<(), std::io::Error>(())
            })
            .run(tokio::time::sleep(Duration::from_millis(10)))
            .await
            .expect("clean shutdown");
    }

    #[tokio::test]
    async fn a_task_that_outlives_the_shutdown_timeout_is_named_and_abandoned() {
        let health = Health::new();
        let started = tokio::time::Instant::now();
        let err = Runner::new()
            .task("prompt", |stop| stop)
            .task("stuck", |_stop| std::future::pending::<()>())
            .task("slow", |stop| async move {
                stop.await;
                tokio::time::sleep(Duration::from_secs(3600)).await;
            })
            .shutdown_timeout(Duration::from_millis(100))
            .with_health(health.clone())
            .run(tokio::time::sleep(Duration::from_millis(10)))
            .await
            .expect_err("the timeout expires");
        assert!(started.elapsed() < Duration::from_secs(5));
        let RunError::ShutdownTimedOut {
            timeout,
            unfinished,
        } = &err
        else {
            panic!("expected a timeout, got {err}");
        };
        assert_eq!(*timeout, Duration::from_millis(100));
        assert_eq!(unfinished, &["stuck", "slow"]);
        assert!(
            err.to_string().starts_with("stuck, slow did not stop"),
            "{err}"
        );
        let s = health.snapshot();
        assert!(!s.live && s.stopping);
        let ended: Vec<_> = s
            .ended_tasks()
            .map(|t| (t.name.as_str(), t.error.is_some()))
            .collect();
        assert_eq!(ended, [("prompt", false), ("stuck", true), ("slow", true)]);
    }
}
