//! What the handlers share: the operator's state and what the server keeps beside it (the
//! failed-authentication throttle, the readiness check's result, the background jobs, the
//! queues' depth history, the Prometheus client).

use std::ops::Deref;

use crate::{
    depth_history::DepthHistory, jobs::Jobs, prometheus::Prometheus, readiness::Readiness,
    state::AdminState, throttle::FailureThrottle,
};

/// What the handlers share: the operator's [`AdminState`] and what the server keeps.
pub(crate) struct Server {
    pub(crate) admin: AdminState,
    pub(crate) throttle: FailureThrottle,
    pub(crate) readiness: Readiness,
    pub(crate) insecure_http: bool,
    pub(crate) jobs: Jobs,
    /// A client of `admin.prometheus_url`.
    pub(crate) prometheus: Option<Prometheus>,
    /// The queues' depths over the last day.
    pub(crate) depths: DepthHistory,
}

impl Deref for Server {
    type Target = AdminState;

    fn deref(&self) -> &AdminState {
        &self.admin
    }
}
