//! # inbox-ops
//!
//! The operator API of rabbit-inbox: what an operator (through `inboxctl` or the admin HTTP
//! API) does when something goes wrong, on a live inbox. Each operation is written once, here;
//! front ends only parse arguments and render results. Also the operations that run on a timer
//! beside a consumer ([`RetentionTask`], [`RecoveryTask`], [`ReleaseTask`]) under a
//! [`rabbit_inbox::Runner`],
//! and [`Service`], which builds a consumer with all of its background work in one place.
//!
//! Feature `management` (off by default) adds the broker's management HTTP API
//! (`ManagementClient`) and the doctor's topology checks that read it; without it the crate
//! needs no HTTP client.
//!
//! This crate sits above the consumer runtime, which knows nothing of it.
//!
//! **Invariant:** an operation that changes a row or moves a message takes an [`Actor`] and
//! writes `inbox_audit` in the same transaction as the change; no operation deletes inbox
//! evidence except retention, which leaves a tombstone.
//!
//! The root names the handle and its vocabulary ([`Operations`], [`Actor`], [`OpsError`],
//! [`Progress`]) and what a service runs beside its consumer ([`Service`], [`RetentionTask`],
//! [`RecoveryTask`], [`ReleaseTask`]); everything else is reached through the module of its action:
//! [`inspect`] (status, list, show, failure groups), [`history`] (one message's timeline),
//! [`activity`] and [`alerts`] (the console's charts and alerts), [`audit`] (the trail),
//! [`reopen`], [`redrive`], [`replay`] (edit and replay), [`recover`], [`release`] (held
//! messages of ordered consumers), [`retention`] (cleanup), [`ordering`] (blocked keys of
//! ordered consumers, skipping their heads), [`doctor`], [`service`], and `management` (the
//! broker's management API).

// The vocabulary every operation speaks, bottom first.
pub mod actor;
mod error;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod operations;
mod progress;
mod sql;
pub mod text;

// The operations, each in the module of its action.
pub mod activity;
pub mod alerts;
pub mod audit;
pub mod doctor;
pub mod history;
pub mod inspect;
#[cfg(feature = "management")]
pub mod management;
pub mod ordering;
pub mod recover;
pub mod redrive;
pub mod release;
pub mod reopen;
pub mod replay;
pub mod retention;
pub mod service;

pub use actor::Actor;
pub use error::OpsError;
pub use operations::Operations;
pub use progress::{NoProgress, Progress};
pub use recover::{RecoveryConfig, RecoveryTask};
pub use release::ReleaseTask;
pub use retention::RetentionTask;
pub use service::{Service, ServiceBuilder};

#[cfg(test)]
mod tests {
    use crate::{
        activity::ActivityQuery,
        actor::Actor,
        alerts::AlertQuery,
        doctor::DoctorRequest,
        inspect::{ListFilter, ShowQuery, StatusQuery},
        operations::Operations,
        progress::NoProgress,
        redrive::RedriveRequest,
        replay::{ReplayEditedRequest, WorkQueue},
    };

    /// The admin HTTP API runs operations on a multi-threaded runtime: their futures must be
    /// `Send` (this compiles only if they are).
    #[allow(dead_code)]
    fn operations_are_send(
        ops: &Operations,
        lot: &rabbit_inbox::broker::ParkingLot,
        actor: &Actor,
        broker: &rabbit_inbox::broker::Broker,
    ) {
        fn send<T: Send>(_: &T) {}
        send(&ops.status(&StatusQuery::default(), Some(lot)));
        send(&ops.list(&ListFilter::default()));
        send(&ops.failure_groups(None));
        send(&ops.reopen("m", "c", actor, false));
        send(&ops.redrive(lot, &RedriveRequest::default(), Some(actor), &NoProgress));
        send(&ops.replay_edited(
            &WorkQueue::new(broker, "q"),
            Some(lot),
            &ReplayEditedRequest::default(),
            actor,
        ));
        send(&ops.doctor(&DoctorRequest::default()));
        send(&ops.blocked_keys("c", 10));
        send(&ops.skip_head(actor, "c", "k", None));
        send(&ops.show(&ShowQuery {
            message_id: "m".into(),
            consumer: None,
            topology: None,
        }));
    }

    /// The admin HTTP API runs these on a multi-threaded runtime too.
    #[allow(dead_code)]
    fn the_console_reads_are_send(ops: &Operations) {
        fn send<T: Send>(_: &T) {}
        send(&ops.activity(&ActivityQuery::default()));
        send(&ops.alerts(&AlertQuery::default()));
        send(&ops.timeline("c", "m", &[]));
    }
}
