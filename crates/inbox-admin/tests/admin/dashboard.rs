//! The dashboard end to end in headless Chromium, driven through chromedriver: enter a token,
//! read the status, open a parked message from its failure group, preview its redrive, run it, and
//! save a screenshot under `target/console-screenshots/`. Skips, saying why, when Chromium or chromedriver is not
//! installed (`apt-get install -y chromium chromium-driver`).

use fantoccini::Locator;

use crate::{
    browser::{Browser, text_of, wait_for_text},
    util::{ADMIN_TOKEN, CONSUMER, Fixture, REFUSED_CODE, REFUSED_TYPE},
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_previews_and_runs_a_redrive_from_a_parked_message() {
    // Dropped in reverse: the browser goes first, then the server with the inbox's schema
    // and queues, also when a step below fails.
    let fx = Fixture::new(None).await;
    let Some(browser) = Browser::open(1400, 1800).await else {
        return;
    };
    let client = &browser.client;

    client.goto(&fx.base).await.expect("the dashboard loads");
    // Without a token the API refuses, and the page says so.
    wait_for_text(client, "#error", "401").await;
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
    let consumers = wait_for_text(client, "#consumers tbody", CONSUMER).await;
    assert!(consumers.contains(CONSUMER), "{consumers}");
    let status = wait_for_text(client, "#status tbody", "PERMANENT_FAILED").await;
    assert!(status.contains("PROCESSED"), "{status}");
    let failures = wait_for_text(client, "#failures tbody", REFUSED_TYPE).await;
    assert!(failures.contains(REFUSED_CODE), "{failures}");
    assert!(
        text_of(client, "#broker").await.contains("parking lot"),
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
    wait_for_text(client, "dd[data-field='status']", "PERMANENT_FAILED").await;
    let detail = text_of(client, "#detail").await;
    assert!(detail.contains("parking_lot"), "{detail}");
    assert!(detail.contains(REFUSED_CODE), "{detail}");
    let payload = text_of(client, "#detail-payload").await;
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
    let summary = wait_for_text(client, "#redrive-summary", "Dry run").await;
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

    browser.screenshot("dashboard-redrive-preview").await;
    // The refused calls before the token are shown on the page, not script errors.
    browser.assert_no_script_errors().await;

    // Showing the payload (and the timeline's error texts) was audited; the preview changed
    // nothing and wrote nothing else.
    assert_eq!(fx.depths().await.parking, 2);
    let audit = fx.audit().await;
    assert!(!audit.is_empty(), "{audit:?}");
    for (actor, action, _, _) in &audit {
        assert_eq!(action, "payload_read", "{audit:?}");
        assert!(actor.contains("alice"), "{audit:?}");
    }

    // The redrive itself: both copies back in the work queue, each audited under the
    // token's name with the reason typed in.
    client
        .find(Locator::Css("#redrive-run"))
        .await
        .expect("redrive button")
        .click()
        .await
        .expect("click");
    let done = wait_for_text(client, "#redrive-summary", "Done").await;
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

    browser
        .client
        .clone()
        .close()
        .await
        .expect("session closes");
}
