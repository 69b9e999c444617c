//! The browser side of the console tests: chromedriver on a free port, a headless Chromium
//! session at a given window size, waiting for text, the page's script errors, and screenshots
//! under `target/console-screenshots/`.

use std::{
    path::{Path, PathBuf},
    str::FromStr,
    time::Duration,
};

use axum::http::Method;
use fantoccini::{Client, ClientBuilder, Locator, wd::WebDriverCompatibleCommand};
use inbox_testkit::env::{DEADLINE, wait_for};
use reqwest::Url;

use crate::util::{LocalProcess, TempDir};

pub(crate) fn on_path(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|p| p.is_file())
    })
}

/// chromedriver on a free port, killed when dropped.
pub(crate) struct Driver(LocalProcess);

impl Driver {
    pub(crate) async fn start(program: &Path) -> Self {
        let process = LocalProcess::spawn(program, |port| vec![format!("--port={port}")]);
        wait_for("chromedriver to listen", async || {
            tokio::net::TcpStream::connect(("127.0.0.1", process.port))
                .await
                .is_ok()
        })
        .await;
        Self(process)
    }
}

pub(crate) async fn text_of(client: &Client, css: &str) -> String {
    client
        .wait()
        .at_most(DEADLINE)
        .for_element(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("{css} appears: {e}"))
        .text()
        .await
        .expect("text")
}

/// Waits until the element at `css` shows text containing `want`.
pub(crate) async fn wait_for_text(client: &Client, css: &str, want: &str) -> String {
    let start = tokio::time::Instant::now();
    loop {
        let text = match client.find(Locator::Css(css)).await {
            Ok(e) => e.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        if text.contains(want) {
            return text;
        }
        let error = match client.find(Locator::Css("#error")).await {
            Ok(e) => e.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        assert!(
            start.elapsed() < DEADLINE,
            "{css} never showed {want:?}; it shows {text:?}; page error {error:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// chromedriver's command reading the browser's console log (and emptying it).
#[derive(Debug)]
struct BrowserLog;

impl WebDriverCompatibleCommand for BrowserLog {
    fn endpoint(
        &self,
        base_url: &Url,
        session_id: Option<&str>,
    ) -> Result<Url, <Url as FromStr>::Err> {
        base_url.join(&format!(
            "session/{}/se/log",
            session_id.unwrap_or_default()
        ))
    }

    fn method_and_body(&self, _: &Url) -> (Method, Option<String>) {
        (Method::POST, Some(r#"{"type":"browser"}"#.to_owned()))
    }
}

/// A headless Chromium session driven through its own chromedriver, with its own profile;
/// `None` (after saying what is missing, which fails the run under
/// `RABBIT_INBOX_REQUIRE_ALL`) when Chromium or chromedriver is not installed. The fields drop
/// in order: the session's driver, then the profile.
pub(crate) struct Browser {
    pub(crate) client: Client,
    _driver: Driver,
    _profile: TempDir,
}

impl Browser {
    pub(crate) async fn open(width: u32, height: u32) -> Option<Self> {
        let (Some(chromium), Some(chromedriver)) = (on_path("chromium"), on_path("chromedriver"))
        else {
            inbox_testkit::missing(
                "chromium and chromedriver",
                "apt-get install -y chromium chromium-driver",
            );
            return None;
        };
        let profile = TempDir::new("inbox-admin-chromium");
        let driver = Driver::start(&chromedriver).await;
        let capabilities = serde_json::json!({
            "goog:chromeOptions": {
                "binary": chromium,
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--hide-scrollbars",
                    format!("--window-size={width},{height}"),
                    format!("--user-data-dir={}", profile.0.display()),
                ],
            },
            // The page's console errors, read by `assert_no_script_errors`.
            "goog:loggingPrefs": { "browser": "SEVERE" },
        });
        let serde_json::Value::Object(capabilities) = capabilities else {
            unreachable!("an object literal");
        };
        let client = ClientBuilder::native()
            .capabilities(capabilities)
            .connect(&driver.0.url)
            .await
            .expect("a Chromium session");
        Some(Self {
            client,
            _driver: driver,
            _profile: profile,
        })
    }

    /// Finds the element at `css` (waiting for it) and clicks it.
    pub(crate) async fn click(&self, css: &str) {
        self.client
            .wait()
            .at_most(DEADLINE)
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css} appears: {e}"))
            .click()
            .await
            .unwrap_or_else(|e| panic!("clicking {css}: {e}"));
    }

    /// Types `text` into the field at `css`, replacing what it held.
    pub(crate) async fn type_into(&self, css: &str, text: &str) {
        let field = self
            .client
            .wait()
            .at_most(DEADLINE)
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("{css} appears: {e}"));
        field.clear().await.expect("clearing a field");
        field.send_keys(text).await.expect("typing");
    }

    /// Fails on any error the page's script raised or logged since the last call: an exception,
    /// a module that did not load, a policy violation. A refused API call is not one (the page
    /// shows it on its error line), but an asset that did not load is.
    pub(crate) async fn assert_no_script_errors(&self) {
        let log = self
            .client
            .issue_cmd(BrowserLog)
            .await
            .expect("the browser's log");
        let errors: Vec<&str> = log
            .as_array()
            .expect("log entries")
            .iter()
            .filter(|entry| {
                let message = entry["message"].as_str().unwrap_or_default();
                entry["source"] != "network" || message.contains("/assets/")
            })
            .map(|entry| entry["message"].as_str().unwrap_or_default())
            .collect();
        assert!(errors.is_empty(), "the page's script failed: {errors:#?}");
    }

    /// Saves a screenshot of the window as `target/console-screenshots/<name>.png`; returns
    /// its path.
    pub(crate) async fn screenshot(&self, name: &str) -> PathBuf {
        let dir =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/console-screenshots");
        std::fs::create_dir_all(&dir).expect("screenshot directory");
        let path = dir.join(format!("{name}.png"));
        let png = self.client.screenshot().await.expect("a screenshot");
        std::fs::write(&path, &png).expect("screenshot saved");
        let path = path.canonicalize().unwrap_or(path);
        println!("console screenshot: {}", path.display());
        path
    }
}
