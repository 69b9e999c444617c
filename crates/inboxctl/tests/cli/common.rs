//! What the command-line tests share: the built `inboxctl` pointed at the test servers, and a
//! guard that removes what a test created.

use std::process::Output;

use inbox_testkit::{amqp_url, database_url};
use rabbit_inbox::{RetryPolicy, SchemaName, Topology, broker::Broker};
use sqlx::{AssertSqlSafe, PgPool};
use tokio::process::Command;

/// Whether a variable of the operator's shell could stand in for a flag a test leaves out on
/// purpose (the `INBOX_*` settings, `INBOXCTL_CONFIG`), or add log lines to the output a test
/// reads (`RUST_LOG`).
fn unset(name: &str) -> bool {
    name == "RUST_LOG" || name.starts_with("INBOX_") || name.starts_with("INBOXCTL_")
}

/// `inboxctl`, reaching the test servers.
pub(crate) fn command() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_inboxctl"));
    command
        .env("DATABASE_URL", database_url())
        .env("AMQP_URL", amqp_url());
    for (name, _) in std::env::vars_os() {
        if unset(&name.to_string_lossy()) {
            command.env_remove(name);
        }
    }
    command
}

/// Runs `inboxctl` with `args` to its end.
pub(crate) async fn inboxctl(args: &[&str]) -> Output {
    command().args(args).output().await.expect("inboxctl runs")
}

/// Removes a test's queues, schemas and roles when dropped, also when the test panics.
pub(crate) struct Cleanup {
    schemas: Vec<SchemaName>,
    roles: Vec<String>,
    queues: Vec<(Topology, RetryPolicy)>,
}

impl Cleanup {
    /// Drops `schema` (and all it holds).
    pub(crate) fn schema(schema: &str) -> Self {
        Self {
            schemas: vec![SchemaName::new(schema).expect("schema name")],
            roles: Vec::new(),
            queues: Vec::new(),
        }
    }

    /// Also drops `role`, after the schemas.
    pub(crate) fn role(mut self, role: String) -> Self {
        self.roles.push(role);
        self
    }

    /// Also deletes `topology`'s queues; the retry tiers are named by the `retry` they were
    /// declared with.
    pub(crate) fn queues(mut self, topology: &Topology, retry: RetryPolicy) -> Self {
        self.queues.push((topology.clone(), retry));
        self
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let (schemas, roles, queues) = (
            std::mem::take(&mut self.schemas),
            std::mem::take(&mut self.roles),
            std::mem::take(&mut self.queues),
        );
        // A thread with a runtime of its own: a test's runtime may be unwinding or gone.
        let _ = std::thread::spawn(move || {
            let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            runtime.block_on(async {
                for (topology, retry) in &queues {
                    // A connection per topology: a failed delete closes the channel.
                    if let Ok(broker) = Broker::connect(&amqp_url(), "inboxctl test cleanup").await
                    {
                        let _ = broker.delete(topology, retry).await;
                        broker.close().await;
                    }
                }
                let Ok(pool) = PgPool::connect(&database_url()).await else {
                    return;
                };
                // Under the schema lock: a migration still running does not recreate it.
                for schema in &schemas {
                    let _ = rabbit_inbox::schema::drop_schema(&pool, schema).await;
                }
                for role in &roles {
                    let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP OWNED BY \"{role}\"")))
                        .execute(&pool)
                        .await;
                    let _ = sqlx::raw_sql(AssertSqlSafe(format!("DROP ROLE IF EXISTS \"{role}\"")))
                        .execute(&pool)
                        .await;
                }
                pool.close().await;
            });
        })
        .join();
    }
}
