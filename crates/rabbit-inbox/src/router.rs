//! Dispatch by message type: a [`Router`] maps a message type (and optionally a version) to a
//! typed handler that gets the decoded payload, the message and the transaction's connection.
//! It is a [`Handler`] (for [`crate::Consumer::new`]) and a [`BatchHandler`] (for
//! [`crate::Consumer::with_batch_handler`]), so it plugs into a consumer like any handler.
//!
//! A message of a type without a route is a permanent failure, `unknown_message_type`, naming
//! the type and the routed ones. A router declared [`RouterBuilder::closed`] also makes the
//! consumer refuse other types when it parses a delivery: they are recorded and parked as
//! invalid without a business transaction, and cannot fail the rest of a batch.

use std::{
    collections::{BTreeMap, HashMap},
    future::Future,
    marker::PhantomData,
    panic::AssertUnwindSafe,
};

use futures::{FutureExt, future::BoxFuture};
use serde::de::DeserializeOwned;
use sqlx::PgConnection;

use crate::{
    envelope::MessageTypes,
    handler::{BatchError, BatchHandler, Handler, HandlerError, InboxMessage},
    status::UNKNOWN_MESSAGE_TYPE,
};

/// A typed handler for one route: gets the payload decoded as `T` (like
/// [`InboxMessage::decode`]: a mismatch is a permanent `payload_mismatch` naming the field
/// path, and the handler does not run), the message and the open transaction's connection.
///
/// Implement it on a struct, or pass an `async fn` (or an async closure that captures
/// nothing) taking `(T, &InboxMessage<'_>, &mut PgConnection)`: those implement it through
/// [`TypedHandlerFn`].
pub trait TypedHandler<T>: Send + Sync + 'static {
    /// Applies the effect of `payload`, from `msg`, inside the open transaction.
    fn handle(
        &self,
        payload: T,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// An `async fn (T, &InboxMessage<'_>, &mut PgConnection) -> Result<(), HandlerError>` (or an
/// async closure of that shape that captures nothing), for every lifetime `'a`: what lets
/// functions be [`TypedHandler`]s with a future that is `Send`. Implemented for every such
/// function; not meant to be implemented by hand.
pub trait TypedHandlerFn<'a, T>: Send + Sync + 'static {
    /// The future of one call.
    type Future: Future<Output = Result<(), HandlerError>> + Send + 'a;

    /// Calls the function.
    fn call(&self, payload: T, msg: &'a InboxMessage<'a>, tx: &'a mut PgConnection)
    -> Self::Future;
}

impl<'a, T, F, Fut> TypedHandlerFn<'a, T> for F
where
    F: Fn(T, &'a InboxMessage<'a>, &'a mut PgConnection) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'a,
{
    type Future = Fut;

    fn call(&self, payload: T, msg: &'a InboxMessage<'a>, tx: &'a mut PgConnection) -> Fut {
        self(payload, msg, tx)
    }
}

impl<T, F> TypedHandler<T> for F
where
    T: Send + 'static,
    F: for<'a> TypedHandlerFn<'a, T>,
{
    async fn handle(
        &self,
        payload: T,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        self.call(payload, msg, tx).await
    }
}

/// A message with its payload decoded, as a [`TypedBatchHandler`] gets it.
#[derive(Debug, Clone)]
pub struct TypedMessage<'a, T> {
    /// The decoded payload.
    pub payload: T,
    /// The message (its key, envelope, attempt, outbox).
    pub msg: InboxMessage<'a>,
}

/// A typed batch handler for one route: gets the route's messages of a batch at once, their
/// payloads decoded as `T`, for set-based writes. Same contract as [`BatchHandler`]: indexes
/// in a [`BatchError`] are into `msgs`, effects stay inside `tx`.
pub trait TypedBatchHandler<T>: Send + Sync + 'static {
    /// Applies the effects of `msgs` inside the open transaction.
    fn handle_batch(
        &self,
        msgs: Vec<TypedMessage<'_, T>>,
        tx: &mut PgConnection,
    ) -> impl Future<Output = Result<(), BatchError>> + Send;
}

/// What a route answers to: a message type, and a version or every version. Made from a type
/// name (`"OrderPlaced"`: every version without a route of its own) or a pair
/// (`("OrderPlaced", 2)`: version 2 only, taking precedence).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteKey {
    message_type: String,
    version: Option<i32>,
}

impl RouteKey {
    /// Every version of `message_type` that has no route of its own.
    pub fn any_version(message_type: impl Into<String>) -> Self {
        Self {
            message_type: message_type.into(),
            version: None,
        }
    }

    /// `version` of `message_type`.
    pub fn version(message_type: impl Into<String>, version: i32) -> Self {
        Self {
            message_type: message_type.into(),
            version: Some(version),
        }
    }
}

impl From<&str> for RouteKey {
    fn from(message_type: &str) -> Self {
        Self::any_version(message_type)
    }
}

impl From<String> for RouteKey {
    fn from(message_type: String) -> Self {
        Self::any_version(message_type)
    }
}

impl From<(&str, i32)> for RouteKey {
    fn from((message_type, version): (&str, i32)) -> Self {
        Self::version(message_type, version)
    }
}

impl From<(String, i32)> for RouteKey {
    fn from((message_type, version): (String, i32)) -> Self {
        Self::version(message_type, version)
    }
}

impl std::fmt::Display for RouteKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.version {
            Some(v) => write!(f, "{:?} version {v}", self.message_type),
            None => write!(f, "{:?} (any version)", self.message_type),
        }
    }
}

/// A router that cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    /// Two routes for the same type and version: the second would silently replace the first.
    #[error("two routes for {0}: register each message type and version once")]
    DuplicateRoute(RouteKey),
    /// A route for an empty message type, which no message has (a message without a type has
    /// the type `unknown`).
    #[error("a route names an empty message type")]
    EmptyMessageType,
    /// No route at all: every message would be parked.
    #[error("the router has no route: add one with route or route_batch")]
    NoRoutes,
}

/// Builds a [`Router`]; see [`Router::builder`].
pub struct RouterBuilder {
    routes: Vec<(RouteKey, Box<dyn ErasedRoute>)>,
    closed: bool,
    reorder: bool,
}

impl std::fmt::Debug for RouterBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterBuilder")
            .field(
                "routes",
                &self.routes.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            )
            .field("closed", &self.closed)
            .field("reorder", &self.reorder)
            .finish()
    }
}

impl RouterBuilder {
    /// Routes messages of `key` (a type, or a `(type, version)` pair) to `handler`, one
    /// message per call, with the payload decoded as `T`.
    #[must_use]
    pub fn route<T, H>(mut self, key: impl Into<RouteKey>, handler: H) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        H: TypedHandler<T>,
    {
        let route = Each {
            handler,
            payload: PhantomData,
        };
        self.routes.push((key.into(), Box::new(route)));
        self
    }

    /// Routes messages of `key` to `handler`, which gets the route's messages of a batch at
    /// once (with [`crate::Consumer::with_batch_handler`]; one at a time with
    /// [`crate::Consumer::new`]).
    #[must_use]
    pub fn route_batch<T, H>(mut self, key: impl Into<RouteKey>, handler: H) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        H: TypedBatchHandler<T>,
    {
        let route = Batch {
            handler,
            payload: PhantomData,
        };
        self.routes.push((key.into(), Box::new(route)));
        self
    }

    /// Declares the routes the whole contract: a consumer running this router refuses any
    /// other type (or version) when it parses a delivery. The message is then recorded and
    /// parked as invalid (`unknown_message_type`) without a business transaction, so it never
    /// costs a batch a rollback. The consumer also fails to start if its
    /// `envelope.accepted_types` is set to anything else.
    #[must_use]
    pub fn closed(mut self) -> Self {
        self.closed = true;
        self
    }

    /// In the batch form, gives each batch route all of a batch's messages of its route in one
    /// call, instead of each run of consecutive ones. Fewer, larger calls, but messages of
    /// different routes no longer take effect in delivery order (an aggregate's
    /// `OrderCancelled` could be applied before its `OrderPlaced` of the same batch): only for
    /// routes whose effects do not depend on each other.
    #[must_use]
    pub fn reorder_by_type(mut self) -> Self {
        self.reorder = true;
        self
    }

    /// The router, or why it cannot be built: two routes for one (type, version), a route
    /// without a type, or no route.
    pub fn build(self) -> Result<Router, RouterError> {
        if self.routes.is_empty() {
            return Err(RouterError::NoRoutes);
        }
        let mut by_type: HashMap<String, TypeRoutes> = HashMap::new();
        let mut types = MessageTypes::new();
        let mut routes = Vec::with_capacity(self.routes.len());
        for (key, route) in self.routes {
            if key.message_type.is_empty() {
                return Err(RouterError::EmptyMessageType);
            }
            let index = routes.len();
            let entry = by_type.entry(key.message_type.clone()).or_default();
            let slot = match key.version {
                None => &mut entry.any,
                Some(v) => entry.versions.entry(v).or_default(),
            };
            if slot.replace(index).is_some() {
                return Err(RouterError::DuplicateRoute(key));
            }
            types.insert(key.message_type.clone(), key.version);
            routes.push((key, route));
        }
        Ok(Router {
            routes,
            by_type,
            types,
            closed: self.closed,
            reorder: self.reorder,
        })
    }
}

/// The routes of one message type: by version, and for every other version.
#[derive(Debug, Default)]
struct TypeRoutes {
    versions: BTreeMap<i32, Option<usize>>,
    any: Option<usize>,
}

/// Dispatches each message to the typed handler of its type and version (see the
/// [module](self)). Build it with [`Router::builder`]:
///
/// ```no_run
/// use rabbit_inbox::{HandlerError, InboxMessage, Router};
/// use sqlx::PgConnection;
///
/// #[derive(serde::Deserialize)]
/// struct OrderPlaced { order_id: String }
///
/// async fn place(order: OrderPlaced, _msg: &InboxMessage<'_>, tx: &mut PgConnection) -> Result<(), HandlerError> {
///     sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind(order.order_id).execute(&mut *tx).await?;
///     Ok(())
/// }
///
/// # fn build() -> Result<Router, rabbit_inbox::RouterError> {
/// let router = Router::builder().route("OrderPlaced", place).build()?;
/// # Ok(router) }
/// ```
pub struct Router {
    routes: Vec<(RouteKey, Box<dyn ErasedRoute>)>,
    by_type: HashMap<String, TypeRoutes>,
    types: MessageTypes,
    closed: bool,
    reorder: bool,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("types", &self.types.to_string())
            .field("closed", &self.closed)
            .field("reorder", &self.reorder)
            .finish_non_exhaustive()
    }
}

impl Router {
    /// A builder without routes.
    pub fn builder() -> RouterBuilder {
        RouterBuilder {
            routes: Vec::new(),
            closed: false,
            reorder: false,
        }
    }

    /// The routed types and versions.
    pub fn types(&self) -> &MessageTypes {
        &self.types
    }

    /// The route of `message_type` in `version`: its own, else the type's any-version route.
    fn route_index(&self, message_type: &str, version: i32) -> Option<usize> {
        let routes = self.by_type.get(message_type)?;
        routes
            .versions
            .get(&version)
            .copied()
            .flatten()
            .or(routes.any)
    }

    fn route_of(&self, msg: &InboxMessage<'_>) -> Result<usize, HandlerError> {
        let envelope = msg.envelope();
        self.route_index(&envelope.message_type, envelope.message_version)
            .ok_or_else(|| self.unknown(&envelope.message_type, envelope.message_version))
    }

    /// The permanent failure of a message without a route. The type is bounded by its field
    /// limit and stored in its own column anyway, so the detail may name it.
    fn unknown(&self, message_type: &str, version: i32) -> HandlerError {
        let what = if self.by_type.contains_key(message_type) {
            format!("message type {message_type:?} has no route for version {version}")
        } else {
            format!("message type {message_type:?} has no route")
        };
        let text = format!("{what} (routed: {})", self.types);
        HandlerError::permanent(UNKNOWN_MESSAGE_TYPE, text.clone()).with_safe_detail(text)
    }

    /// The batch's routed messages as groups of one route each, indexes into the batch:
    /// each run of consecutive messages of one route, or with `reorder` all of a route's.
    fn groups(&self, routed: &[(usize, usize)]) -> Vec<(usize, Vec<usize>)> {
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for &(i, route) in routed {
            let group = if self.reorder {
                groups.iter_mut().find(|(r, _)| *r == route)
            } else {
                groups.last_mut().filter(|(r, _)| *r == route)
            };
            match group {
                Some((_, members)) => members.push(i),
                None => groups.push((route, vec![i])),
            }
        }
        groups
    }
}

impl Handler for Router {
    async fn handle(
        &self,
        msg: &InboxMessage<'_>,
        tx: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        let route = self.route_of(msg)?;
        self.routes[route].1.handle_one(msg, tx).await
    }

    /// An unknown type or version is refused before the batch's handlers run.
    fn check(&self, msg: &InboxMessage<'_>) -> Result<(), HandlerError> {
        self.route_of(msg).map(|_| ())
    }

    fn message_types(&self) -> Option<MessageTypes> {
        Some(self.types.clone())
    }

    fn refuses_other_types(&self) -> bool {
        self.closed
    }
}

impl BatchHandler for Router {
    /// Decodes the whole batch first: unknown types and payload mismatches are named together
    /// ([`BatchError::Messages`]) before any handler runs, so the batch runs again once
    /// without them and no effect is done twice. Then runs each group of one route in delivery
    /// order, mapping its handler's indexes back to the batch.
    async fn handle_batch(
        &self,
        msgs: &[InboxMessage<'_>],
        tx: &mut PgConnection,
    ) -> Result<(), BatchError> {
        let mut failed = Vec::new();
        let mut routed = Vec::with_capacity(msgs.len());
        for (i, msg) in msgs.iter().enumerate() {
            match self.route_of(msg) {
                Ok(route) => routed.push((i, route)),
                Err(error) => failed.push((i, error)),
            }
        }
        let mut prepared = Vec::new();
        for (route, members) in self.groups(&routed) {
            let group: Vec<InboxMessage<'_>> = members.iter().map(|&i| msgs[i]).collect();
            match self.routes[route].1.prepare(group) {
                Ok(ready) => prepared.push((route, members, ready)),
                Err(errors) => {
                    failed.extend(errors.into_iter().map(|(j, e)| (members[j], e)));
                }
            }
        }
        if !failed.is_empty() {
            failed.sort_by_key(|(i, _)| *i);
            return Err(BatchError::Messages(failed));
        }
        for (route, members, ready) in prepared {
            // A panic is this group's failure: blamed on its message when it has one, else the
            // consumer finds the culprit by running the messages one by one.
            let result = AssertUnwindSafe(ready.run(&mut *tx))
                .catch_unwind()
                .await
                .unwrap_or_else(|panic| Err(BatchError::Batch(HandlerError::panicked(&*panic))));
            if let Err(error) = result {
                return Err(to_batch_indexes(error, &members, &self.routes[route].0));
            }
        }
        Ok(())
    }

    fn message_types(&self) -> Option<MessageTypes> {
        Some(self.types.clone())
    }

    fn refuses_other_types(&self) -> bool {
        self.closed
    }
}

/// A group's error with indexes into the batch (`members[i]` is the batch index of the group's
/// `i`th message). A failure the group's handler could not attribute is its message's when
/// the group has one; an index outside the group makes the consumer find the culprit.
fn to_batch_indexes(error: BatchError, members: &[usize], route: &RouteKey) -> BatchError {
    let out_of_range = |index: usize| {
        BatchError::Batch(HandlerError::retryable(
            "bad_batch_index",
            format!(
                "the batch handler of {route} blamed message {index} of {}",
                members.len()
            ),
        ))
    };
    match error {
        BatchError::Message { index, error } => match members.get(index) {
            Some(&index) => BatchError::Message { index, error },
            None => out_of_range(index),
        },
        BatchError::Messages(errors) => {
            let mut mapped = Vec::with_capacity(errors.len());
            for (index, error) in errors {
                match members.get(index) {
                    Some(&index) => mapped.push((index, error)),
                    None => return out_of_range(index),
                }
            }
            BatchError::Messages(mapped)
        }
        BatchError::Batch(error) => match members {
            [index] => BatchError::Message {
                index: *index,
                error,
            },
            _ => BatchError::Batch(error),
        },
    }
}

/// A route with its payload type erased.
trait ErasedRoute: Send + Sync {
    /// Decodes and handles one message.
    fn handle_one<'a>(
        &'a self,
        msg: &'a InboxMessage<'a>,
        tx: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;

    /// Decodes a group: ready to run, or the failures by index into `msgs`.
    fn prepare<'a>(
        &'a self,
        msgs: Vec<InboxMessage<'a>>,
    ) -> Result<Box<dyn Prepared<'a> + 'a>, Vec<(usize, HandlerError)>>;
}

/// A decoded group of one route, ready to run in a transaction.
trait Prepared<'a>: Send {
    fn run<'t>(self: Box<Self>, tx: &'t mut PgConnection) -> BoxFuture<'t, Result<(), BatchError>>
    where
        'a: 't;
}

/// Decodes every message of a group: all the payloads, or every failure.
fn decode_all<'a, T: DeserializeOwned>(
    msgs: Vec<InboxMessage<'a>>,
) -> Result<Vec<TypedMessage<'a, T>>, Vec<(usize, HandlerError)>> {
    let mut decoded = Vec::with_capacity(msgs.len());
    let mut failed = Vec::new();
    for (i, msg) in msgs.into_iter().enumerate() {
        match msg.decode::<T>() {
            Ok(payload) => decoded.push(TypedMessage { payload, msg }),
            Err(error) => failed.push((i, error)),
        }
    }
    if failed.is_empty() {
        Ok(decoded)
    } else {
        Err(failed)
    }
}

/// A per-message route.
struct Each<T, H> {
    handler: H,
    payload: PhantomData<fn() -> T>,
}

impl<T, H> ErasedRoute for Each<T, H>
where
    T: DeserializeOwned + Send + 'static,
    H: TypedHandler<T>,
{
    fn handle_one<'a>(
        &'a self,
        msg: &'a InboxMessage<'a>,
        tx: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let payload = msg.decode::<T>()?;
            self.handler.handle(payload, msg, tx).await
        })
    }

    fn prepare<'a>(
        &'a self,
        msgs: Vec<InboxMessage<'a>>,
    ) -> Result<Box<dyn Prepared<'a> + 'a>, Vec<(usize, HandlerError)>> {
        let msgs = decode_all::<T>(msgs)?;
        Ok(Box::new(EachReady {
            handler: &self.handler,
            msgs,
        }))
    }
}

struct EachReady<'a, T, H> {
    handler: &'a H,
    msgs: Vec<TypedMessage<'a, T>>,
}

impl<'a, T, H> Prepared<'a> for EachReady<'a, T, H>
where
    T: Send + 'static,
    H: TypedHandler<T>,
{
    fn run<'t>(self: Box<Self>, tx: &'t mut PgConnection) -> BoxFuture<'t, Result<(), BatchError>>
    where
        'a: 't,
    {
        Box::pin(async move {
            for (index, TypedMessage { payload, msg }) in self.msgs.into_iter().enumerate() {
                // A panic is this message's failure; the others of the group are innocent.
                let error = match AssertUnwindSafe(self.handler.handle(payload, &msg, tx))
                    .catch_unwind()
                    .await
                {
                    Ok(Ok(())) => continue,
                    Ok(Err(error)) => error,
                    Err(panic) => HandlerError::panicked(&*panic),
                };
                return Err(BatchError::Message { index, error });
            }
            Ok(())
        })
    }
}

/// A batch route.
struct Batch<T, H> {
    handler: H,
    payload: PhantomData<fn() -> T>,
}

impl<T, H> ErasedRoute for Batch<T, H>
where
    T: DeserializeOwned + Send + 'static,
    H: TypedBatchHandler<T>,
{
    /// A batch of one; its failure, whatever the shape, is the message's.
    fn handle_one<'a>(
        &'a self,
        msg: &'a InboxMessage<'a>,
        tx: &'a mut PgConnection,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(async move {
            let payload = msg.decode::<T>()?;
            let one = vec![TypedMessage { payload, msg: *msg }];
            self.handler
                .handle_batch(one, tx)
                .await
                .map_err(|e| match e {
                    BatchError::Message { error, .. } | BatchError::Batch(error) => error,
                    BatchError::Messages(errors) => match errors.into_iter().next() {
                        Some((_, error)) => error,
                        None => HandlerError::retryable(
                            "batch_failed",
                            "batch handler reported failed messages without naming one",
                        ),
                    },
                })
        })
    }

    fn prepare<'a>(
        &'a self,
        msgs: Vec<InboxMessage<'a>>,
    ) -> Result<Box<dyn Prepared<'a> + 'a>, Vec<(usize, HandlerError)>> {
        let msgs = decode_all::<T>(msgs)?;
        Ok(Box::new(BatchReady {
            handler: &self.handler,
            msgs,
        }))
    }
}

struct BatchReady<'a, T, H> {
    handler: &'a H,
    msgs: Vec<TypedMessage<'a, T>>,
}

impl<'a, T, H> Prepared<'a> for BatchReady<'a, T, H>
where
    T: Send + 'static,
    H: TypedBatchHandler<T>,
{
    fn run<'t>(self: Box<Self>, tx: &'t mut PgConnection) -> BoxFuture<'t, Result<(), BatchError>>
    where
        'a: 't,
    {
        Box::pin(self.handler.handle_batch(self.msgs, tx))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use serde_json::json;

    use super::*;
    use crate::{
        envelope::{AmqpMessage, Envelope, EnvelopeRules, parse},
        handler::ErrorKind,
        outbox::Outbox,
        schema::SchemaName,
    };

    #[derive(Debug, serde::Deserialize)]
    #[allow(dead_code)]
    struct Placed {
        order_id: String,
    }

    async fn placed(
        _: Placed,
        _: &InboxMessage<'_>,
        _: &mut PgConnection,
    ) -> Result<(), HandlerError> {
        Ok(())
    }

    struct Shipped;

    impl TypedBatchHandler<serde_json::Value> for Shipped {
        async fn handle_batch(
            &self,
            _: Vec<TypedMessage<'_, serde_json::Value>>,
            _: &mut PgConnection,
        ) -> Result<(), BatchError> {
            Ok(())
        }
    }

    fn envelope(message_type: &str, version: i32, body: serde_json::Value) -> Envelope {
        let mut headers = serde_json::Map::new();
        headers.insert("x-message-version".into(), json!(version));
        parse(
            AmqpMessage {
                message_id: Some("m1".into()),
                kind: Some(message_type.into()),
                headers,
                body: body.to_string().into_bytes(),
                ..AmqpMessage::default()
            },
            &EnvelopeRules {
                supported_versions: 1..=9,
                ..EnvelopeRules::default()
            },
        )
        .expect("valid")
    }

    fn router() -> Router {
        Router::builder()
            .route("OrderPlaced", placed)
            .route(("OrderPlaced", 2), placed)
            .route_batch(("OrderShipped", 1), Shipped)
            .build()
            .expect("distinct routes")
    }

    #[test]
    fn a_version_route_takes_precedence_over_the_any_version_one() {
        let r = router();
        assert_eq!(r.route_index("OrderPlaced", 1), Some(0));
        assert_eq!(r.route_index("OrderPlaced", 2), Some(1));
        assert_eq!(r.route_index("OrderPlaced", 7), Some(0));
        assert_eq!(r.route_index("OrderShipped", 1), Some(2));
        assert_eq!(
            r.route_index("OrderShipped", 2),
            None,
            "no any-version route"
        );
        assert_eq!(
            r.route_index("orderplaced", 1),
            None,
            "types are case-sensitive"
        );
        assert_eq!(r.types().to_string(), "OrderPlaced, OrderShipped v1");
        assert!(r.types().contains("OrderPlaced", 5));
        assert!(!r.types().contains("OrderShipped", 2));
    }

    #[test]
    fn the_same_type_and_version_twice_is_refused() {
        let twice = Router::builder()
            .route("OrderPlaced", placed)
            .route_batch(("OrderShipped", 1), Shipped)
            .route(String::from("OrderPlaced"), placed)
            .build()
            .expect_err("duplicate");
        assert_eq!(
            twice,
            RouterError::DuplicateRoute(RouteKey::any_version("OrderPlaced"))
        );
        let err = Router::builder()
            .route(("OrderPlaced", 3), placed)
            .route_batch(("OrderPlaced", 3), Shipped)
            .build()
            .expect_err("duplicate version");
        assert_eq!(
            err.to_string(),
            "two routes for \"OrderPlaced\" version 3: register each message type and version once"
        );
        assert_eq!(
            Router::builder().build().expect_err("empty"),
            RouterError::NoRoutes
        );
        assert_eq!(
            Router::builder()
                .route("", placed)
                .build()
                .expect_err("no type"),
            RouterError::EmptyMessageType
        );
    }

    #[test]
    fn an_unknown_type_is_permanent_and_names_the_routed_ones() {
        let r = router();
        let outbox = Outbox::new(SchemaName::default());
        let emitted = AtomicU32::new(0);
        let unknown = envelope("InvoiceSent", 1, json!({}));
        let msg = InboxMessage {
            envelope: &unknown,
            consumer_name: "svc",
            attempt: 1,
            outbox: &outbox,
            emitted: &emitted,
        };
        let err = r.route_of(&msg).expect_err("no route");
        assert_eq!(err.kind(), ErrorKind::Permanent);
        assert_eq!(err.code(), "unknown_message_type");
        assert_eq!(
            err.safe_detail(),
            Some(
                "message type \"InvoiceSent\" has no route (routed: OrderPlaced, OrderShipped v1)"
            )
        );
        let other_version = envelope("OrderShipped", 2, json!({}));
        let msg = InboxMessage {
            envelope: &other_version,
            ..msg
        };
        let err = r.route_of(&msg).expect_err("no route for v2");
        assert!(
            err.message()
                .starts_with("message type \"OrderShipped\" has no route for version 2"),
            "{}",
            err.message()
        );
    }

    #[test]
    fn groups_keep_delivery_order_unless_reordered() {
        // Batch indexes with their routes: A A B A C C.
        let routed = [(0, 0), (1, 0), (2, 1), (3, 0), (4, 2), (5, 2)];
        assert_eq!(
            router().groups(&routed),
            [(0, vec![0, 1]), (1, vec![2]), (0, vec![3]), (2, vec![4, 5])]
        );
        let reordered = Router::builder()
            .route("A", placed)
            .reorder_by_type()
            .build()
            .expect("router");
        assert_eq!(
            reordered.groups(&routed),
            [(0, vec![0, 1, 3]), (1, vec![2]), (2, vec![4, 5])]
        );
    }

    #[test]
    fn a_groups_errors_name_messages_of_the_batch() {
        let route = RouteKey::version("OrderShipped", 1);
        let members = [2, 5, 7];
        let fail = || HandlerError::retryable("down", "down");
        let mapped = to_batch_indexes(
            BatchError::Message {
                index: 1,
                error: fail(),
            },
            &members,
            &route,
        );
        assert!(
            matches!(mapped, BatchError::Message { index: 5, .. }),
            "{mapped:?}"
        );
        let mapped = to_batch_indexes(
            BatchError::Messages(vec![(0, fail()), (2, fail())]),
            &members,
            &route,
        );
        let BatchError::Messages(errors) = mapped else {
            panic!("still several messages: {mapped:?}");
        };
        assert_eq!(errors.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [2, 7]);
        // Unattributed: the consumer finds the culprit, unless the group has one message.
        let mapped = to_batch_indexes(BatchError::Batch(fail()), &members, &route);
        assert!(matches!(mapped, BatchError::Batch(_)), "{mapped:?}");
        let mapped = to_batch_indexes(BatchError::Batch(fail()), &[4], &route);
        assert!(
            matches!(mapped, BatchError::Message { index: 4, .. }),
            "{mapped:?}"
        );
        // An index outside the group is not trusted.
        let mapped = to_batch_indexes(
            BatchError::Message {
                index: 3,
                error: fail(),
            },
            &members,
            &route,
        );
        let BatchError::Batch(error) = mapped else {
            panic!("not attributed: {mapped:?}");
        };
        assert_eq!(error.code(), "bad_batch_index");
        assert!(
            error.message().contains("\"OrderShipped\" version 1"),
            "{}",
            error.message()
        );
    }

    #[test]
    fn a_group_decodes_every_message_and_names_each_mismatch() {
        let outbox = Outbox::new(SchemaName::default());
        let emitted = AtomicU32::new(0);
        let good = envelope("OrderPlaced", 1, json!({"order_id": "o-1"}));
        let bad = envelope("OrderPlaced", 1, json!({"order_id": 17}));
        let msg = |envelope| InboxMessage {
            envelope,
            consumer_name: "svc",
            attempt: 1,
            outbox: &outbox,
            emitted: &emitted,
        };
        let decoded = decode_all::<Placed>(vec![msg(&good), msg(&good)]).expect("both decode");
        assert_eq!(decoded[1].payload.order_id, "o-1");
        let failed =
            decode_all::<Placed>(vec![msg(&good), msg(&bad), msg(&bad)]).expect_err("mismatches");
        assert_eq!(failed.iter().map(|(i, _)| *i).collect::<Vec<_>>(), [1, 2]);
        let (_, error) = &failed[0];
        assert_eq!(error.kind(), ErrorKind::Permanent);
        assert_eq!(error.code(), "payload_mismatch");
        assert!(
            error.safe_detail().is_some_and(|d| d.contains("order_id")),
            "{error:?}"
        );
    }

    #[test]
    fn async_closures_that_capture_nothing_are_handlers() {
        let r = Router::builder()
            .route(
                "Noted",
                async |note: serde_json::Value, msg: &InboxMessage<'_>, tx: &mut PgConnection| {
                    sqlx::query("INSERT INTO notes (id, note) VALUES ($1, $2)")
                        .bind(msg.message_id())
                        .bind(note)
                        .execute(&mut *tx)
                        .await?;
                    Ok(())
                },
            )
            .build()
            .expect("router");
        assert_eq!(r.route_index("Noted", 1), Some(0));
    }

    #[test]
    fn a_closed_router_declares_its_types_and_refuses_others() {
        let open = router();
        assert!(!Handler::refuses_other_types(&open));
        let closed = Router::builder()
            .route("OrderPlaced", placed)
            .closed()
            .build()
            .expect("router");
        assert!(Handler::refuses_other_types(&closed));
        assert!(BatchHandler::refuses_other_types(&closed));
        assert_eq!(
            BatchHandler::message_types(&closed),
            Some(MessageTypes::new().with_type("OrderPlaced"))
        );
    }
}
