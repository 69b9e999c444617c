//! The dashboard: one HTML page, its script and its style sheet, compiled into the binary.
//! The page holds no data; it calls the JSON API with the token the operator enters (kept in
//! the browser tab's sessionStorage), so it needs no token itself.
//!
//! The page is served with a Content-Security-Policy that allows this origin's script and
//! style sheet only (the assets hold no inline script, style or event handler), API calls to
//! this origin, no framing and no form posted elsewhere: an injected string, were one ever
//! written as HTML, could neither run nor send the token away.

use axum::{http::header, response::IntoResponse};

const INDEX: &str = include_str!("../assets/index.html");
const SCRIPT: &str = include_str!("../assets/app.js");
const STYLE: &str = include_str!("../assets/app.css");

/// The dashboard's Content-Security-Policy.
pub(crate) const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; \
    frame-ancestors 'none'";

/// Headers every asset gets: no caching across versions, no framing, no sniffing, and the
/// policy.
type Headers = [(header::HeaderName, &'static str); 5];

fn headers(content_type: &'static str) -> Headers {
    [
        (header::CONTENT_TYPE, content_type),
        (header::CACHE_CONTROL, "no-cache"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::CONTENT_SECURITY_POLICY, POLICY),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The policy forbids inline script and style: the assets must have none.
    #[test]
    fn the_page_has_no_inline_script_style_or_handler() {
        let page = INDEX.to_ascii_lowercase();
        for script in page.split("<script").skip(1) {
            let (open, rest) = script.split_once('>').expect("a closed tag");
            assert!(open.contains("src="), "inline script: {open}");
            assert!(rest.trim_start().starts_with("</script>"), "script body");
        }
        assert!(!page.contains("<style"), "inline style sheet");
        assert!(!page.contains(" style="), "inline style attribute");
        assert!(!page.contains(" on"), "inline event handler");
        assert!(!page.contains("javascript:"), "javascript: URL");
        assert!(!SCRIPT.contains("innerHTML") && !SCRIPT.contains("eval("));
    }
}
