//! The dashboard end to end in headless Chromium, driven through chromedriver: enter a token,
//! read the status, open a parked message from its failure group, preview its redrive, run it, and
//! save a screenshot under `target/`. Skips, saying why, when Chromium or chromedriver is not
//! installed (`apt-get install -y chromium chromium-driver`).

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use fantoccini::{Client, ClientBuilder, Locator};
use inbox_testkit::env::{DEADLINE, wait_for};

use crate::util::{ADMIN_TOKEN, CONSUMER, Fixture, REFUSED_CODE, REFUSED_TYPE, TempDir};

fn on_path(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|p| p.is_file())
    })
}

/// chromedriver on a free port, killed when dropped.
struct Driver {
    child: Child,
    url: String,
}

impl Driver {
    async fn start(program: &Path) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(program)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let driver = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        wait_for("chromedriver to listen", async || {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
        })
        .await;
        driver
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn text_of(client: &Client, css: &str) -> String {
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
async fn wait_for_text(client: &Client, css: &str, want: &str) -> String {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_previews_and_runs_a_redrive_from_a_parked_message() {
    let (Some(chromium), Some(chromedriver)) = (on_path("chromium"), on_path("chromedriver"))
    else {
        inbox_testkit::missing(
            "chromium and chromedriver",
            "apt-get install -y chromium chromium-driver",
        );
        return;
    };
    // Dropped in reverse: the browser and chromedriver go first, then the profile, then the
    // server with the inbox's schema and queues, also when a step below fails.
    let fx = Fixture::new(None).await;
    let profile = TempDir::new("inbox-admin-chromium");
    let driver = Driver::start(&chromedriver).await;
    let capabilities = serde_json::json!({
        "goog:chromeOptions": {
            "binary": chromium,
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync",
                "--window-size=1400,1800",
                format!("--user-data-dir={}", profile.0.display()),
            ],
        }
    });
    let serde_json::Value::Object(capabilities) = capabilities else {
        unreachable!("an object literal");
    };
    let client = ClientBuilder::native()
        .capabilities(capabilities)
        .connect(&driver.url)
        .await
        .expect("a Chromium session");

    client.goto(&fx.base).await.expect("the dashboard loads");
    // Without a token the API refuses, and the page says so.
    wait_for_text(&client, "#error", "401").await;
    client
        .find(Locator::Css("#token"))
        .await
        .expect("token field")
        .send_keys(ADMIN_TOKEN)
        .await
        .expect("typing");
    client
        .find(Locator::Css("#token-save"))
        .await
        .expect("button")
        .click()
        .await
        .expect("click");

    // Status per consumer and the failure groups.
    let consumers = wait_for_text(&client, "#consumers tbody", CONSUMER).await;
    assert!(consumers.contains(CONSUMER), "{consumers}");
    let status = wait_for_text(&client, "#status tbody", "PERMANENT_FAILED").await;
    assert!(status.contains("PROCESSED"), "{status}");
    let failures = wait_for_text(&client, "#failures tbody", REFUSED_TYPE).await;
    assert!(failures.contains(REFUSED_CODE), "{failures}");
    assert!(
        text_of(&client, "#broker").await.contains("parking lot"),
        "broker depths shown"
    );

    // A parked message's detail, from its group's sample.
    client
        .find(Locator::Css("#failures a.sample"))
        .await
        .expect("a sample link")
        .click()
        .await
        .expect("click");
    wait_for_text(&client, "dd[data-field='status']", "PERMANENT_FAILED").await;
    let detail = text_of(&client, "#detail").await;
    assert!(detail.contains("parking_lot"), "{detail}");
    assert!(detail.contains(REFUSED_CODE), "{detail}");
    let payload = text_of(&client, "#detail-payload").await;
    assert!(payload.contains("refund-"), "{payload}");

    // The redrive preview: a dry run over this consumer, type and error code.
    client
        .find(Locator::Css("#reason"))
        .await
        .expect("reason field")
        .send_keys("refunds supported since 2.4")
        .await
        .expect("typing");
    client
        .find(Locator::Css("#redrive-preview"))
        .await
        .expect("preview button")
        .click()
        .await
        .expect("click");
    let summary = wait_for_text(&client, "#redrive-summary", "Dry run").await;
    assert!(summary.contains("reopen 2"), "{summary}");
    assert!(summary.contains("would_move 2"), "{summary}");
    assert!(
        client
            .find(Locator::Css("#redrive-run"))
            .await
            .expect("redrive button")
            .is_enabled()
            .await
            .expect("state"),
        "after a preview that would move copies, the redrive button is enabled"
    );

    let screenshot = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/dashboard-redrive-preview.png");
    let png = client.screenshot().await.expect("a screenshot");
    std::fs::write(&screenshot, &png).expect("screenshot saved");
    println!(
        "dashboard screenshot: {}",
        screenshot.canonicalize().unwrap_or(screenshot).display()
    );

    // Showing the payload was audited; the preview changed nothing and wrote nothing.
    assert_eq!(fx.depths().await.parking, 2);
    let audit = fx.audit().await;
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0].1, "payload_read", "{audit:?}");
    assert!(audit[0].0.contains("alice"), "{audit:?}");

    // The redrive itself: both copies back in the work queue, each audited under the
    // token's name with the reason typed in.
    client
        .find(Locator::Css("#redrive-run"))
        .await
        .expect("redrive button")
        .click()
        .await
        .expect("click");
    let done = wait_for_text(&client, "#redrive-summary", "Done").await;
    assert!(done.contains("moved 2"), "{done}");
    let depths = fx.depths().await;
    assert_eq!((depths.parking, depths.work), (0, 2), "{depths:?}");
    let audit: Vec<_> = fx
        .audit()
        .await
        .into_iter()
        .filter(|(_, action, _, _)| action != "payload_read")
        .collect();
    assert_eq!(audit.len(), 2, "{audit:?}");
    for (actor, _, _, reason) in &audit {
        assert!(actor.contains("alice"), "{audit:?}");
        assert_eq!(reason, "refunds supported since 2.4");
    }
    assert!(
        !client
            .find(Locator::Css("#redrive-run"))
            .await
            .expect("redrive button")
            .is_enabled()
            .await
            .expect("state"),
        "a redrive needs a new preview before it can run again"
    );

    client.close().await.expect("session closes");
}
