//! The application's routes: the documented API (each group behind its guard), its OpenAPI
//! document, the console's page and assets, and the headers every response gets.

use std::sync::Arc;

use axum::{
    Json, Router,
    http::{HeaderValue, header},
    middleware,
    routing::get,
};
use utoipa::{
    Modify, OpenApi,
    openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme},
};
use utoipa_axum::{router::OpenApiRouter, routes};

use crate::{
    api, console, dashboard, depths,
    error::{self, ApiError},
    guard, health, host,
    listen::ServeOptions,
    missing_inbox, ordering,
    server::Server,
};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "rabbit-inbox admin API",
        description = "Inspection and audited operator actions on a rabbit-inbox inbox. Read \
            endpoints need a bearer token of any scope (read, read:payload, admin); payloads, \
            headers and error texts are returned to read:payload and admin tokens only, each \
            read audited; actions need an admin token and a reason. The token's name is \
            recorded as the actor. Errors are JSON: {\"error\": ..., \"request_id\": ...}."
    ),
    modifiers(&BearerAuth),
    tags((name = "health"), (name = "inspection"), (name = "actions"))
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The documented routes, each group behind its guard.
fn api_routes(state: &Arc<Server>) -> OpenApiRouter<Arc<Server>> {
    let open = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz));
    let read = OpenApiRouter::new()
        .routes(routes!(health::metrics))
        .routes(routes!(api::status))
        .routes(routes!(api::list))
        .routes(routes!(api::show))
        .routes(routes!(api::failures))
        .routes(routes!(api::doctor, api::doctor_pass))
        .routes(routes!(console::activity))
        .routes(routes!(depths::depths))
        .routes(routes!(console::alerts))
        .routes(routes!(console::timeline))
        .routes(routes!(console::audit))
        .routes(routes!(ordering::blocked_keys))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard::read));
    let admin = OpenApiRouter::new()
        .routes(routes!(api::recover))
        .routes(routes!(api::redrive))
        .routes(routes!(api::reopen))
        .routes(routes!(api::cleanup_dry_run))
        .routes(routes!(api::discard))
        .routes(routes!(console::start_job))
        .routes(routes!(console::job))
        .routes(routes!(console::replay_edited))
        .routes(routes!(ordering::skip_head))
        .route_layer(middleware::from_fn_with_state(state.clone(), guard::admin));
    open.merge(read).merge(admin)
}

/// Headers every response gets unless it sets its own: no sniffing, no caching, no framing,
/// and nothing a browser may load or run from an API response.
fn security_headers(app: Router, tls: bool) -> Router {
    use tower_http::set_header::SetResponseHeaderLayer as Set;
    let app = app
        .layer(Set::overriding(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ))
        .layer(Set::if_not_present(
            header::CACHE_CONTROL,
            HeaderValue::from_static("no-store"),
        ))
        .layer(Set::if_not_present(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static("default-src 'none'; frame-ancestors 'none'"),
        ))
        .layer(Set::if_not_present(
            header::X_FRAME_OPTIONS,
            HeaderValue::from_static("DENY"),
        ));
    if tls {
        app.layer(Set::if_not_present(
            header::STRICT_TRANSPORT_SECURITY,
            HeaderValue::from_static("max-age=31536000"),
        ))
    } else {
        app
    }
}

/// The whole application: API, OpenAPI document and dashboard, behind the Host check.
pub(crate) fn router(
    server: &Arc<Server>,
    hosts: host::AllowedHosts,
    options: &ServeOptions,
) -> Router {
    let (api, openapi) = api_routes(server).split_for_parts();
    let openapi = Arc::new(openapi);
    let app = api
        .route(
            "/api/v1/openapi.json",
            get(move || {
                let openapi = openapi.clone();
                async move { Json(openapi.as_ref().clone()) }
            }),
        )
        .route("/", get(dashboard::index))
        .route("/assets/js/{module}", get(dashboard::module))
        .route("/assets/app.css", get(dashboard::style))
        .route("/assets/uplot.js", get(dashboard::chart_script))
        .route("/assets/uplot.css", get(dashboard::chart_style))
        .fallback(|| async { ApiError::not_found("no such page or endpoint") })
        .layer(middleware::from_fn_with_state(
            server.clone(),
            missing_inbox::no_inbox,
        ))
        .with_state(server.clone())
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            options.header_read_timeout,
        ))
        .layer(middleware::from_fn_with_state(Arc::new(hosts), host::check));
    security_headers(app, options.tls.is_some()).layer(middleware::from_fn(error::request_id))
}
