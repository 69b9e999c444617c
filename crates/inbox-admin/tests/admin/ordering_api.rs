//! The blocked keys of an ordered consumer through the API: listed to any token (the head's
//! error text to payload readers only), skipped by an admin with a reason, audited under the
//! token's name; refused without a token, to a read token, without a reason and for a head
//! that is not the key's.

use reqwest::StatusCode;
use serde_json::json;

use crate::util::{
    ADMIN_TOKEN, AMENDMENT_CODE, CONSUMER, Fixture, PAYLOAD_TOKEN, READ_TOKEN, tokens,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_keys_are_listed_and_skipped_by_an_admin() {
    let fx = Fixture::inbox().await;
    fx.block_key("customer-7", 45).await;
    fx.block_key("customer-9", 5).await;
    let app = fx.app(tokens());
    let list = format!("/api/v1/consumers/{CONSUMER}/blocked-keys");
    let skip = format!("{list}/skip");

    let (code, _) = app.get(&list, None).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
    let (code, keys) = app.get(&list, Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::OK, "{keys}");
    let keys = keys.as_array().cloned().expect("an array");
    let names: Vec<&str> = keys
        .iter()
        .filter_map(|k| k["order_key"].as_str())
        .collect();
    assert_eq!(names, ["customer-7", "customer-9"], "oldest first");
    let first = &keys[0];
    assert_eq!(first["reason"], "head");
    assert_eq!(first["head_message_id"], "customer-7-head");
    assert_eq!(first["head_status"], "PERMANENT_FAILED");
    assert_eq!(first["head_error_code"], AMENDMENT_CODE);
    assert_eq!(first["head_error"], json!(null), "hidden from a read token");
    assert_eq!(first["held"], 2);
    assert!(
        first["age_seconds"].as_f64().is_some_and(|a| a >= 2700.0),
        "{first}"
    );
    let (_, keys) = app.get(&list, Some(PAYLOAD_TOKEN)).await;
    assert_eq!(keys[0]["head_error"], "amendments are not supported yet");
    let (code, err) = app.get(&format!("{list}?limit=0"), Some(READ_TOKEN)).await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{err}");

    // Refused: no token, a read token, no reason, another head than the key's.
    let body = json!({ "order_key": "customer-7", "expected_head": "customer-7-head",
                       "reason": "amendment voided by the customer", "ticket": "INC-31" });
    let (code, _) = app.post(&skip, None, body.clone()).await;
    assert_eq!(code, StatusCode::UNAUTHORIZED);
    let (code, _) = app.post(&skip, Some(READ_TOKEN), body.clone()).await;
    assert_eq!(code, StatusCode::FORBIDDEN);
    let blank = json!({ "order_key": "customer-7", "reason": " " });
    let (code, _) = app.post(&skip, Some(ADMIN_TOKEN), blank).await;
    assert_eq!(code, StatusCode::BAD_REQUEST);
    let other = json!({ "order_key": "customer-7", "expected_head": "customer-9-head",
                        "reason": "wrong head" });
    let (code, err) = app.post(&skip, Some(ADMIN_TOKEN), other).await;
    assert_eq!(code, StatusCode::BAD_REQUEST, "{err}");
    assert!(
        err["error"]
            .as_str()
            .is_some_and(|e| e.contains("blocked by customer-7-head")),
        "{err}"
    );
    assert!(fx.audit().await.is_empty(), "nothing refused was audited");

    let (code, skipped) = app.post(&skip, Some(ADMIN_TOKEN), body).await;
    assert_eq!(code, StatusCode::OK, "{skipped}");
    assert_eq!(skipped["skipped"], "head");
    assert_eq!(skipped["head_message_id"], "customer-7-head");
    assert_eq!(
        (skipped["held"].clone(), skipped["to_release"].clone()),
        (json!(2), json!(2))
    );
    assert_eq!(
        fx.audit().await,
        [(
            "alice".to_owned(),
            "skip_head".to_owned(),
            Some("customer-7-head".to_owned()),
            "amendment voided by the customer".to_owned()
        )]
    );
    let ticket: Option<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT ticket FROM \"{}\".inbox_audit",
        fx.env.schema.as_str()
    )))
    .fetch_one(&fx.env.pool)
    .await
    .expect("the audit row");
    assert_eq!(ticket.as_deref(), Some("INC-31"));
    let head = fx
        .env
        .record(CONSUMER, "customer-7-head")
        .await
        .expect("the head's row is kept");
    assert_eq!(head.status.to_string(), "PERMANENT_FAILED");
    let (_, keys) = app.get(&list, Some(READ_TOKEN)).await;
    assert_eq!(keys.as_array().map(Vec::len), Some(1), "{keys}");
    assert_eq!(keys[0]["order_key"], "customer-9");
}
