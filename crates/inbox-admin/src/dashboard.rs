//! The console: one HTML page, its script (ES modules under `assets/js`, loaded by the browser
//! as they are: no build step), its style sheet, and the chart library it draws with (uPlot,
//! vendored under `assets/vendor/uplot`), all compiled into the binary: the page loads nothing
//! from elsewhere, so it works on a server without internet access.
//! The page holds no data; it calls the JSON API with the token the operator enters (kept in
//! the browser tab's sessionStorage), so it needs no token itself.
//!
//! The page is served with a Content-Security-Policy that allows this origin's script and
//! style sheet only (the assets hold no inline script, style or event handler), API calls to
//! this origin, no framing and no form posted elsewhere: an injected string, were one ever
//! written as HTML, could neither run nor send the token away.

use axum::{
    extract::Path,
    http::header,
    response::{IntoResponse, Response},
};

use crate::error::ApiError;

const INDEX: &str = include_str!("../assets/index.html");
/// The script's modules by file name, served under `/assets/js/`: the page loads `main.js`,
/// which imports the others.
const MODULES: [(&str, &str); 15] = [
    ("main.js", include_str!("../assets/js/main.js")),
    ("api.js", include_str!("../assets/js/api.js")),
    ("blocked.js", include_str!("../assets/js/blocked.js")),
    ("bulk.js", include_str!("../assets/js/bulk.js")),
    ("charts.js", include_str!("../assets/js/charts.js")),
    ("dom.js", include_str!("../assets/js/dom.js")),
    (
        "edit-replay.js",
        include_str!("../assets/js/edit-replay.js"),
    ),
    ("format.js", include_str!("../assets/js/format.js")),
    (
        "group-redrive.js",
        include_str!("../assets/js/group-redrive.js"),
    ),
    ("message.js", include_str!("../assets/js/message.js")),
    ("overview.js", include_str!("../assets/js/overview.js")),
    ("page-error.js", include_str!("../assets/js/page-error.js")),
    (
        "redrive-report.js",
        include_str!("../assets/js/redrive-report.js"),
    ),
    ("search.js", include_str!("../assets/js/search.js")),
    ("statuses.js", include_str!("../assets/js/statuses.js")),
];
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

/// One of the script's modules, as JavaScript (a browser runs a module only with a
/// JavaScript content type).
pub(crate) async fn module(Path(name): Path<String>) -> Response {
    match MODULES.iter().find(|(file, _)| *file == name) {
        Some((_, text)) => (headers("text/javascript; charset=utf-8"), *text).into_response(),
        None => ApiError::not_found(format!("no console module {name:?}")).into_response(),
    }
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
        for (file, text) in MODULES {
            assert!(
                !text.contains("innerHTML") && !text.contains("eval("),
                "{file} writes HTML or runs strings"
            );
        }
    }

    /// Every module in `assets/js` is served, and every module imported is one of them.
    #[test]
    fn every_module_is_served_and_every_import_resolves() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/js");
        let mut on_disk: Vec<String> = std::fs::read_dir(dir)
            .expect("the modules' directory")
            .map(|entry| {
                entry
                    .expect("an entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        on_disk.sort();
        let mut served: Vec<String> = MODULES.iter().map(|(file, _)| (*file).to_owned()).collect();
        served.sort();
        assert_eq!(served, on_disk, "MODULES lists the files of assets/js");
        for (file, text) in MODULES {
            for import in text.split(" from \"./").skip(1) {
                let imported = import.split_once('"').expect("a closed string").0;
                assert!(
                    MODULES.iter().any(|(f, _)| *f == imported),
                    "{file} imports {imported}, which is not served"
                );
            }
        }
        assert!(INDEX.contains("<script type=\"module\" src=\"/assets/js/main.js\">"));
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
