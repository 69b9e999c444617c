//! The dashboard: one HTML page, its script and its style sheet, compiled into the binary.
//! The page holds no data; it calls the JSON API with the token the operator enters (kept in
//! the browser tab's sessionStorage), so it needs no token itself.

use axum::{http::header, response::IntoResponse};

const INDEX: &str = include_str!("../assets/index.html");
const SCRIPT: &str = include_str!("../assets/app.js");
const STYLE: &str = include_str!("../assets/app.css");

/// Headers every asset gets: no caching across versions, no framing, no sniffing.
type Headers = [(header::HeaderName, &'static str); 4];

fn headers(content_type: &'static str) -> Headers {
    [
        (header::CONTENT_TYPE, content_type),
        (header::CACHE_CONTROL, "no-cache"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    ]
}

pub(crate) async fn index() -> impl IntoResponse {
    (headers("text/html; charset=utf-8"), INDEX)
}

pub(crate) async fn script() -> impl IntoResponse {
    (headers("text/javascript; charset=utf-8"), SCRIPT)
}

pub(crate) async fn style() -> impl IntoResponse {
    (headers("text/css; charset=utf-8"), STYLE)
}
