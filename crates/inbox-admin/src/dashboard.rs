//! The console: one HTML page, its script and style sheet, and the chart library it draws with
//! (uPlot, vendored under `assets/vendor/uplot`), all compiled into the binary: the page loads
//! nothing from elsewhere, so it works on a server without internet access.
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
const CHART_SCRIPT: &str = include_str!("../assets/vendor/uplot/uPlot.iife.min.js");
const CHART_STYLE: &str = include_str!("../assets/vendor/uplot/uPlot.min.css");

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

pub(crate) async fn chart_script() -> impl IntoResponse {
    (headers("text/javascript; charset=utf-8"), CHART_SCRIPT)
}

pub(crate) async fn chart_style() -> impl IntoResponse {
    (headers("text/css; charset=utf-8"), CHART_STYLE)
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
        for tag in page.split('<').skip(1) {
            let open = tag.split_once('>').map_or(tag, |(open, _)| open);
            let handler = open
                .split_whitespace()
                .find(|attr| attr.starts_with("on") && attr.contains('='));
            assert!(handler.is_none(), "inline event handler: <{open}>");
        }
        assert!(!page.contains("javascript:"), "javascript: URL");
        assert!(!SCRIPT.contains("innerHTML") && !SCRIPT.contains("eval("));
    }

    /// The chart library runs under the same policy: no code built from strings, no style
    /// sheet injected at run time (uPlot sets element styles through the CSSOM, which the
    /// policy allows).
    #[test]
    fn the_chart_library_needs_nothing_the_policy_forbids() {
        for forbidden in [
            "eval(",
            "new Function",
            "createElement(\"style\")",
            "insertRule",
        ] {
            assert!(!CHART_SCRIPT.contains(forbidden), "{forbidden}");
        }
        assert!(CHART_SCRIPT.contains("uPlot"));
    }
}
