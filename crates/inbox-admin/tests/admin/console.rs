//! An operator's night in the console, in headless Chromium over a real inbox with a running
//! consumer: the overview's charts and an alert banner, finding a message by id and reading its
//! timeline, a bulk redrive of a failure group with its preview and audit trail, editing and
//! replaying a poisoned message, skipping the head of a blocked ordering key, and the charts
//! moving while the consumer processes.
//! Screenshots at desktop (1920x1080) and laptop (1366x768) widths are saved under
//! `target/console-screenshots/`.

use fantoccini::{Client, Locator};
use inbox_testkit::env::{DEADLINE, message, wait_for};
use serde_json::json;

use crate::{
    browser::{Browser, text_of, wait_for_text},
    util::{
        ADMIN_TOKEN, AMENDMENT_CODE, CAPTURE_TYPE, CONSUMER, Fixture, NEGATIVE_CODE, OrderHandler,
        REFUSED_CODE, REFUSED_TYPE,
    },
};

/// Waits until the attribute `name` of the element at `css` satisfies `ok`; returns its value.
async fn wait_for_attr(
    client: &Client,
    css: &str,
    name: &str,
    ok: impl Fn(&str) -> bool,
) -> String {
    let start = tokio::time::Instant::now();
    loop {
        let value = match client.find(Locator::Css(css)).await {
            Ok(e) => e.attr(name).await.ok().flatten().unwrap_or_default(),
            Err(_) => String::new(),
        };
        if ok(&value) {
            return value;
        }
        assert!(
            start.elapsed() < DEADLINE,
            "{css} [{name}] is still {value:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

async fn audited(fx: &Fixture, action: &str) -> usize {
    fx.audit().await.iter().filter(|a| a.1 == action).count()
}

async fn shown(client: &Client, css: &str) -> bool {
    match client.find(Locator::Css(css)).await {
        Ok(e) => e.is_displayed().await.unwrap_or(false),
        Err(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_night_in_the_console() {
    // Dropped in reverse: the browser first, then the consumer, then the server and inbox.
    let fx = Fixture::new(None).await;
    // A capture whose producer flipped the amount's sign: refused for good, parked.
    let capture = message(
        Some("capture-7"),
        CAPTURE_TYPE,
        &json!({ "capture": "capture-7", "order": "order-2", "amount": -1250, "currency": "EUR" }),
    );
    fx.env.publish(&fx.topology, &capture).await;
    let consumer = fx
        .env
        .start(fx.env.config(CONSUMER, fx.topology.clone()), OrderHandler);
    wait_for("the capture parked", async || {
        fx.depths().await.parking == 3
    })
    .await;
    // A claim whose process died an hour ago: what the stuck-rows alert is for.
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{}\".message_inbox (message_id, consumer_name, message_type, \
           message_version, payload_sha256, status, processing_started_at, first_received_at, \
           last_received_at) \
         VALUES ('order-0', '{CONSUMER}', 'OrderPlaced', 1, sha256('order-0'::bytea), \
           'PROCESSING', now() - interval '1 hour', now() - interval '1 hour', \
           now() - interval '1 hour')",
        fx.env.schema
    )))
    .execute(&fx.env.pool)
    .await
    .expect("a stuck row");

    let Some(browser) = Browser::open(1920, 1080).await else {
        return;
    };
    let client = &browser.client;
    client.goto(&fx.base).await.expect("the console loads");
    browser.type_into("#token", ADMIN_TOKEN).await;
    browser.click("#token-save").await;

    // The overview: a card per consumer with its charts drawn, the figures of the window, and
    // the stuck row as a banner.
    let card = format!(".card[data-consumer='{CONSUMER}']");
    wait_for_attr(client, &card, "data-processed", |v| v == "3").await;
    assert_eq!(
        wait_for_attr(client, &card, "data-parked", |v| !v.is_empty()).await,
        "3"
    );
    for chart in ["activity", "latency"] {
        client
            .find(Locator::Css(&format!("{card} .{chart} canvas")))
            .await
            .unwrap_or_else(|e| panic!("the {chart} chart is drawn: {e}"));
    }
    let banner = wait_for_text(
        client,
        "#alerts .banner[data-alert='InboxStaleProcessing']",
        CONSUMER,
    )
    .await;
    assert!(banner.contains("InboxStaleProcessing"), "{banner}");
    let figures = text_of(client, &format!("{card} .figures")).await;
    assert!(figures.contains("PROCESSING 1"), "{figures}");
    assert!(figures.contains("PERMANENT_FAILED 3"), "{figures}");
    wait_for_text(client, "#failures tbody", CAPTURE_TYPE).await;
    browser.screenshot("overview-desktop").await;
    browser.assert_no_script_errors().await;

    // The charts move while the consumer processes: twenty more orders, seen on the next
    // live refresh without touching the page; the depth chart keeps its samples.
    for n in 10..30 {
        let id = format!("order-{n}");
        let order = message(Some(&id), "OrderPlaced", &json!({ "order": id }));
        fx.env.publish(&fx.topology, &order).await;
    }
    wait_for_attr(client, &card, "data-processed", |v| v == "23").await;
    let samples = wait_for_attr(client, "#depth-chart", "data-samples", |v| {
        v.parse::<u32>().is_ok_and(|n| n >= 2)
    })
    .await;
    assert!(samples.parse::<u32>().expect("a count") >= 2);

    // "A consumer processed this twice?": find a message by its id, read what happened to it.
    browser.click("#nav-messages").await;
    browser.type_into("#q-message-id", "refund-1").await;
    browser.click("#search-run").await;
    wait_for_text(client, "#messages tbody", "refund-1").await;
    browser.click("#messages a.message").await;
    wait_for_text(client, "dd[data-field='status']", "PERMANENT_FAILED").await;
    let parked = text_of(client, "#timeline li[data-kind='parked']").await;
    assert!(parked.contains(REFUSED_CODE), "{parked}");
    assert!(parked.contains("refunds are not supported yet"), "{parked}");
    let first = text_of(client, "#timeline li:first-child").await;
    assert!(first.contains("first received"), "{first}");
    assert!(text_of(client, "#detail-headers").await.contains('{'));
    browser.screenshot("message-timeline-desktop").await;
    // A processed order is found by id as well (every status, not only open rows).
    browser.click("#nav-messages").await;
    browser.type_into("#q-message-id", "order-2").await;
    browser.click("#search-run").await;
    let found = wait_for_text(client, "#messages tbody", "order-2").await;
    assert!(found.contains("PROCESSED"), "{found}");

    // A bulk redrive of the refunds' failure group: preview, then run, with its audit trail.
    browser.click("#nav-overview").await;
    wait_for_text(client, "#failures tbody", REFUSED_TYPE).await;
    let rows = client
        .find_all(Locator::Css("#failures tbody tr"))
        .await
        .expect("failure rows");
    let mut refunds = None;
    for row in rows {
        if row.text().await.expect("text").contains(REFUSED_TYPE) {
            refunds = Some(row);
        }
    }
    refunds
        .expect("the refunds' group")
        .find(Locator::Css("a.bulk"))
        .await
        .expect("its bulk action")
        .click()
        .await
        .expect("click");
    let scope = wait_for_text(client, "#bulk-scope", REFUSED_CODE).await;
    assert!(scope.contains("2 rows"), "{scope}");
    browser
        .type_into("#bulk-reason", "refunds supported since 2.4")
        .await;
    browser.type_into("#bulk-ticket", "OPS-1234").await;
    browser.click("#bulk-preview").await;
    let preview = wait_for_text(client, "#bulk-summary", "Dry run").await;
    assert!(preview.contains("would_move 2"), "{preview}");
    assert!(!preview.contains("would_move 3"), "{preview}");
    browser.screenshot("bulk-preview-desktop").await;
    assert_eq!(audited(&fx, "reopen").await, 0, "a preview changes nothing");
    browser.click("#bulk-run").await;
    let done = wait_for_text(client, "#bulk-summary", "Done").await;
    assert!(done.contains("moved 2"), "{done}");
    let trail = wait_for_text(client, "#bulk-audit", "reopen").await;
    assert!(
        trail.contains("refund-1") && trail.contains("refund-2"),
        "{trail}"
    );
    assert!(trail.contains("OPS-1234"), "{trail}");
    assert_eq!(audited(&fx, "reopen").await, 2);
    browser.screenshot("bulk-done-desktop").await;
    // The consumer still refuses refunds: both come back to the parking lot.
    wait_for("the refunds parked again", async || {
        fx.depths().await.parking == 3
    })
    .await;

    // The poisoned capture: edit its body, check the diff, replay it as a new message.
    browser.click("#nav-messages").await;
    browser.type_into("#q-message-id", "capture-7").await;
    browser.click("#search-run").await;
    wait_for_text(client, "#messages tbody", "capture-7").await;
    browser.click("#messages a.message").await;
    let status = wait_for_text(client, "dd[data-field='status']", "PERMANENT_FAILED").await;
    assert!(status.contains("PERMANENT_FAILED"));
    assert!(text_of(client, "#detail").await.contains(NEGATIVE_CODE));
    assert!(
        shown(client, "#edit-section").await,
        "a parked JSON body can be edited"
    );
    let original = client
        .find(Locator::Css("#edit-body"))
        .await
        .expect("the editor")
        .prop("value")
        .await
        .expect("its value")
        .unwrap_or_default();
    assert!(original.contains("-1250"), "{original}");
    browser
        .type_into("#edit-body", &original.replace("-1250", "1250"))
        .await;
    browser
        .type_into("#edit-reason", "the producer flipped the sign")
        .await;
    browser.type_into("#edit-ticket", "PAY-88").await;
    browser.click("#edit-preview").await;
    let diff = wait_for_text(client, "#edit-diff", "1250").await;
    assert!(diff.contains("-   \"amount\": -1250"), "{diff}");
    assert!(diff.contains("+   \"amount\": 1250"), "{diff}");
    wait_for_text(client, "#edit-result", "/amount").await;
    browser.screenshot("edit-and-replay-desktop").await;
    browser.click("#edit-run").await;
    wait_for_text(client, "#edit-result", "Replayed as").await;
    let replacement = wait_for_attr(client, "#edit-result", "data-replacement", |v| {
        !v.is_empty()
    })
    .await;
    wait_for("the replacement processed", async || {
        fx.env
            .scalar(&format!(
                "SELECT count(*) FROM {{s}}.message_inbox WHERE message_id = '{replacement}' \
                 AND status = 'PROCESSED'"
            ))
            .await
            == 1
    })
    .await;
    browser.click("#edit-result a.replacement").await;
    wait_for_text(client, "#detail-id", &replacement).await;
    wait_for_text(client, "dd[data-field='status']", "PROCESSED").await;
    wait_for_text(client, "dd[data-field='replaces']", "capture-7").await;
    browser.click("dd[data-field='replaces'] a").await;
    wait_for_text(client, "dd[data-field='replaced by']", &replacement).await;
    let status = wait_for_text(client, "dd[data-field='status']", "PROCESSED").await;
    assert!(
        status.contains("PROCESSED"),
        "the original is resolved, not deleted"
    );
    let replay = text_of(client, "#timeline li[data-action='replay_edited']").await;
    assert!(replay.contains("the producer flipped the sign"), "{replay}");
    assert!(replay.contains("PAY-88"), "{replay}");
    assert!(
        !shown(client, "#edit-section").await,
        "a replaced message is not edited again"
    );
    assert_eq!(
        fx.depths().await.parking,
        2,
        "the original's parked copy is gone"
    );

    // Two ordered keys blocked behind parked amendments and one waiting for a missing
    // sequence number: the blocked-keys view, and the oldest key's head skipped with a reason
    // and a ticket (the head stays parked).
    fx.block_key("customer-7", 42).await;
    fx.block_key("customer-9", 3).await;
    fx.hold_after_gap("customer-12", 4, 6, 11).await;
    browser.click("#nav-blocked").await;
    let table = wait_for_text(client, "#blocked-keys tbody", "customer-9").await;
    let first = text_of(client, "#blocked-keys tbody tr:first-child").await;
    assert!(first.contains("customer-7-head"), "oldest first: {table}");
    assert!(
        first.contains(AMENDMENT_CODE) && first.contains("42m"),
        "{first}"
    );
    let gap = text_of(client, "#blocked-keys tr[data-key='customer-12']").await;
    assert!(
        gap.contains("sequence gap") && gap.contains("4 / 6"),
        "{gap}"
    );
    browser
        .click("#blocked-keys tr[data-key='customer-7'] a.skip")
        .await;
    wait_for_text(client, "#skip-what", "customer-7-head").await;
    browser
        .type_into("#skip-reason", "amendment withdrawn by the customer")
        .await;
    browser.type_into("#skip-ticket", "ORD-77").await;
    browser.screenshot("blocked-keys-desktop").await;
    assert_eq!(audited(&fx, "skip_head").await, 0, "asking changes nothing");
    browser.click("#skip-run").await;
    let done = wait_for_text(client, "#skip-result", "Skipped the head customer-7-head").await;
    assert!(done.contains("2 of 2 held message(s) go on"), "{done}");
    wait_for_text(client, "#blocked-summary", "2 key(s)").await;
    assert_eq!(audited(&fx, "skip_head").await, 1);
    let head = fx
        .env
        .record(CONSUMER, "customer-7-head")
        .await
        .expect("the head's row is kept");
    assert!(head.status.is_parked(), "{:?}", head.status);
    browser.assert_no_script_errors().await;

    // The same console at laptop width.
    client
        .set_window_size(1366, 768)
        .await
        .expect("window resized");
    browser.screenshot("message-laptop").await;
    browser.click("#nav-overview").await;
    // The replacement (and its original, resolved as processed) in the charts.
    wait_for_attr(client, &card, "data-processed", |v| {
        v.parse::<u32>().is_ok_and(|n| n >= 24)
    })
    .await;
    browser.screenshot("overview-laptop").await;
    browser.assert_no_script_errors().await;

    browser
        .client
        .clone()
        .close()
        .await
        .expect("session closes");
    drop(browser);
    consumer.stop().await;
}
