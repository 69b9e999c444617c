//! `inboxctl serve` refuses a bad monitoring URL before it connects to anything, naming the
//! flag and never echoing the URL's password.

use crate::common::inboxctl;

#[tokio::test]
async fn serve_refuses_bad_monitoring_urls_by_name() {
    for (flag, url) in [
        ("--management-url", "ftp://monitor:s3cret@rabbit:15672"),
        ("--management-url", "http://monitor:s3cret@[bad"),
        ("--prometheus-url", "ftp://monitor:s3cret@prometheus:9090"),
    ] {
        let out = inboxctl(&["serve", "--schema", "unused", flag, url]).await;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag} {url}: {stderr}");
        assert!(stderr.contains(flag), "{flag} {url}: {stderr}");
        assert!(!stderr.contains("s3cret"), "{flag} {url}: {stderr}");
    }
}
