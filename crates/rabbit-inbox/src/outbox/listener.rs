//! The wake-up after commit: a task LISTENing on the outbox's channel turns notifications into
//! a coalesced hint ([`tokio::sync::Notify`] keeps at most one permit, however many commits
//! notified). A lost connection is also a hint (notifications sent meanwhile are lost), and the
//! task reconnects with back-off. The relay polls at a bounded interval as well, so a listener
//! that cannot connect slows the relay down to that interval, no more.

use std::{sync::Arc, time::Duration};

use sqlx::{
    PgPool,
    postgres::{PgListener, PgPoolOptions},
};
use tokio::{sync::Notify, task::JoinHandle};

use crate::backoff::Backoff;

/// The running LISTEN task; aborted when dropped.
pub(crate) struct Wakeups {
    notify: Arc<Notify>,
    task: Option<JoinHandle<()>>,
}

impl Wakeups {
    /// Listens on `channel` over a connection of its own (not one of `pool`'s: a LISTEN holds
    /// its connection for good), made with `pool`'s options.
    pub(crate) fn listen(pool: &PgPool, channel: &str, backoff: (Duration, Duration)) -> Self {
        let notify = Arc::new(Notify::new());
        let options = (*pool.connect_options()).clone();
        let task = tokio::spawn(listen_loop(
            options,
            channel.to_owned(),
            notify.clone(),
            backoff,
        ));
        Self {
            notify,
            task: Some(task),
        }
    }

    /// No listener: polling only.
    pub(crate) fn polling() -> Self {
        Self {
            notify: Arc::new(Notify::new()),
            task: None,
        }
    }

    /// Waits for a hint or `timeout`, whichever comes first.
    pub(crate) async fn wait(&self, timeout: Duration) {
        let _ = tokio::time::timeout(timeout, self.notify.notified()).await;
    }
}

impl Drop for Wakeups {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

async fn listen_loop(
    options: sqlx::postgres::PgConnectOptions,
    channel: String,
    notify: Arc<Notify>,
    backoff: (Duration, Duration),
) {
    let backoff = Backoff::new(backoff.0, backoff.1);
    loop {
        let listened = async {
            let pool = PgPoolOptions::new()
                .max_connections(1)
                .min_connections(0)
                .idle_timeout(None)
                .max_lifetime(None)
                .connect_lazy_with(options.clone());
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.listen(&channel).await?;
            Ok::<_, sqlx::Error>(listener)
        }
        .await;
        let mut listener = match listened {
            Ok(listener) => listener,
            Err(e) => {
                let delay = backoff.failed();
                tracing::warn!(error = %e, retry_in = ?delay, channel, "outbox listener cannot connect; polling meanwhile");
                tokio::time::sleep(delay).await;
                continue;
            }
        };
        // Rows may have been committed while no one listened.
        notify.notify_one();
        backoff.succeeded();
        loop {
            match listener.try_recv().await {
                Ok(Some(_)) => notify.notify_one(),
                Ok(None) => {
                    // Reconnected by sqlx; what was sent meanwhile is lost: poll once.
                    tracing::debug!(channel, "outbox listener reconnected");
                    notify.notify_one();
                }
                Err(e) => {
                    tracing::warn!(error = %e, channel, "outbox listener lost its connection");
                    notify.notify_one();
                    break;
                }
            }
        }
    }
}
