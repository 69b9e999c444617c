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
};

use futures::future::BoxFuture;
use tokio::task::JoinSet;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

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

/// A task of a [`Runner`] ended with an error, or panicked.
#[derive(Debug, thiserror::Error)]
#[error("{task} stopped: {source}")]
#[non_exhaustive]
pub struct RunError {
    /// The name the task was added under.
    pub task: String,
    /// Why it stopped.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

/// Runs tasks side by side until a shutdown future completes or one of them ends.
///
/// ```no_run
/// # async fn run(consumer: rabbit_inbox::Consumer<()>, relay: rabbit_inbox::Relay,
/// #     sampler: rabbit_inbox::InboxSampler) -> Result<(), rabbit_inbox::RunError> {
/// use rabbit_inbox::{Runner, shutdown_signal};
///
/// Runner::new()
///     .task("consumer", |stop| consumer.run(stop))
///     .task("relay", |stop| relay.run(stop))
///     .task("sampler", |stop| sampler.run(stop))
///     .run(shutdown_signal())
///     .await
/// # }
/// ```
///
/// When `shutdown` completes, every task is told to stop (each drains as its own `run`
/// documents) and the run returns once all have. A task that ends by itself, with an error or
/// without, stops the others too: a consumer whose relay has given up on its configuration
/// should not go on filling an outbox nobody empties, and a process supervisor restarts the
/// whole. The first error is returned; later ones are logged.
#[must_use = "a runner does nothing until `run` is awaited"]
pub struct Runner {
    stop: CancellationToken,
    tasks: Vec<(String, BoxFuture<'static, Result<(), BoxError>>)>,
}

impl fmt::Debug for Runner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Runner")
            .field(
                "tasks",
                &self.tasks.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl Default for Runner {
    fn default() -> Self {
        Self::new()
    }
}

impl Runner {
    /// A runner with no tasks.
    pub fn new() -> Self {
        Self {
            stop: CancellationToken::new(),
            tasks: Vec::new(),
        }
    }

    /// Adds the task `start` returns when given the run's [`Shutdown`]; `name` is how logs
    /// and a [`RunError`] refer to it.
    pub fn task<F, Fut, E>(mut self, name: impl Into<String>, start: F) -> Self
    where
        F: FnOnce(Shutdown) -> Fut,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let task = start(Shutdown(Box::pin(self.stop.clone().cancelled_owned())));
        self.tasks.push((
            name.into(),
            Box::pin(async move { task.await.map_err(Into::into) }),
        ));
        self
    }

    /// Runs every task until `shutdown` completes or one of them ends, then stops the others
    /// and waits for them.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), RunError> {
        let mut running = JoinSet::new();
        let mut names = HashMap::new();
        for (name, task) in self.tasks {
            names.insert(running.spawn(task).id(), name);
        }
        let mut first_error = None;
        let mut shutdown = std::pin::pin!(shutdown);
        tokio::select! {
            () = &mut shutdown => {}
            Some(ended) = running.join_next_with_id() => {
                note(ended, &names, &mut first_error, true);
            }
        }
        self.stop.cancel();
        while let Some(ended) = running.join_next_with_id().await {
            note(ended, &names, &mut first_error, false);
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// Records how a task ended.
fn note(
    ended: Result<(tokio::task::Id, Result<(), BoxError>), tokio::task::JoinError>,
    names: &HashMap<tokio::task::Id, String>,
    first_error: &mut Option<RunError>,
    before_shutdown: bool,
) {
    let (id, result) = match ended {
        Ok((id, result)) => (id, result),
        Err(e) => (e.id(), Err(format!("the task failed: {e}").into())),
    };
    let task = names.get(&id).cloned().unwrap_or_default();
    match result {
        Ok(()) if before_shutdown => {
            tracing::warn!(%task, "task ended before shutdown; stopping the others");
        }
        Ok(()) => {}
        Err(source) if first_error.is_none() => {
            tracing::error!(%task, error = %source, "task stopped; stopping the others");
            *first_error = Some(RunError { task, source });
        }
        Err(source) => tracing::error!(%task, error = %source, "task stopped"),
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
        assert_eq!(err.task, "fails");
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
        assert_eq!(err.task, "panics");
    }
}
