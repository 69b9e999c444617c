//! The Prometheus server an operator may point the console at (`AdminState::prometheus_url`):
//! the shipped alert rules' state, and the consumers' own latency quantiles.
//!
//! Failures come back as text for the server's log only: the URL may carry credentials and the
//! client's errors name hosts, so callers tell the browser no more than "did not answer".

use std::{collections::HashMap, time::Duration};

use chrono::{DateTime, Utc};
use serde::Deserialize;

use crate::state::BROKER_TIMEOUT;

/// The histogram behind the console's latency chart when the consumers' metrics are scraped:
/// receipt to settlement of each delivery (handler, transaction and ack).
const LATENCY_HISTOGRAM: &str = rabbit_inbox::telemetry::metrics::DELIVERY_TO_SETTLE;

/// The shortest range a rate is taken over: two scrapes at Prometheus's default one-minute
/// interval, so a bucket narrower than that still gets a value.
const MIN_RATE_RANGE: Duration = Duration::from_secs(120);

/// One alert as Prometheus reports it (names starting with `Inbox` only).
#[derive(Debug)]
pub(crate) struct RuleAlert {
    pub(crate) name: String,
    pub(crate) severity: String,
    pub(crate) consumer: Option<String>,
    pub(crate) summary: String,
    /// `firing` or `pending`.
    pub(crate) state: String,
}

/// p50 and p99 in milliseconds per bucket of one consumer, `None` where Prometheus had no
/// value (no deliveries, or no scrape yet).
pub(crate) type Quantiles = Vec<(Option<f64>, Option<f64>)>;

/// A client of one Prometheus server.
#[derive(Clone)]
pub(crate) struct Prometheus {
    base: String,
    client: reqwest::Client,
}

impl std::fmt::Debug for Prometheus {
    /// Not the URL: it may hold credentials.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prometheus").finish_non_exhaustive()
    }
}

impl Prometheus {
    pub(crate) fn new(base: &str) -> Self {
        Self {
            base: base.trim_end_matches('/').to_owned(),
            client: reqwest::Client::new(),
        }
    }

    async fn get<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        query: &[(&str, String)],
    ) -> Result<T, String> {
        let mut url = reqwest::Url::parse(&format!("{}{path}", self.base))
            .map_err(|e| format!("the Prometheus URL: {e}"))?;
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        self.client
            .get(url)
            .timeout(BROKER_TIMEOUT)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())
    }

    /// The shipped rules' alerts (`/api/v1/alerts`), pending and firing.
    pub(crate) async fn alerts(&self) -> Result<Vec<RuleAlert>, String> {
        #[derive(Deserialize)]
        struct Answer {
            data: Data,
        }
        #[derive(Deserialize)]
        struct Data {
            alerts: Vec<Alert>,
        }
        #[derive(Deserialize)]
        struct Alert {
            labels: HashMap<String, String>,
            #[serde(default)]
            annotations: HashMap<String, String>,
            state: String,
        }
        let answer: Answer = self.get("/api/v1/alerts", &[]).await?;
        Ok(answer
            .data
            .alerts
            .into_iter()
            .filter_map(|mut a| {
                let name = a.labels.remove("alertname")?;
                name.starts_with("Inbox").then(|| RuleAlert {
                    name,
                    severity: a.labels.remove("severity").unwrap_or_default(),
                    consumer: a.labels.remove("consumer"),
                    summary: a
                        .annotations
                        .remove("summary")
                        .or_else(|| a.annotations.remove("description"))
                        .unwrap_or_default(),
                    state: a.state,
                })
            })
            .collect())
    }

    /// p50 and p99 of [`LATENCY_HISTOGRAM`] per consumer (one, or every consumer scraped), for
    /// `count` buckets of `width` starting at `first`: each bucket's value is taken at its end,
    /// over the bucket (at least [`MIN_RATE_RANGE`]). Consumers Prometheus has no series of
    /// are absent.
    pub(crate) async fn latency(
        &self,
        consumer: Option<&str>,
        first: DateTime<Utc>,
        width: Duration,
        count: usize,
    ) -> Result<HashMap<String, Quantiles>, String> {
        let step = width.as_secs().max(1);
        let start = first.timestamp() + step as i64;
        let end = start + step as i64 * count.saturating_sub(1) as i64;
        let (p50, p99) = tokio::try_join!(
            self.quantile_range(0.5, consumer, width, start, end, step),
            self.quantile_range(0.99, consumer, width, start, end, step),
        )?;
        let mut out: HashMap<String, Quantiles> = HashMap::new();
        for (q, series) in [(0, p50), (1, p99)] {
            for (name, points) in series {
                let buckets = out.entry(name).or_insert_with(|| vec![(None, None); count]);
                for (at, value) in points {
                    let index = (at - start as f64) / step as f64;
                    if index < 0.0 || index.fract() != 0.0 || index as usize >= count {
                        continue;
                    }
                    let slot = &mut buckets[index as usize];
                    *(if q == 0 { &mut slot.0 } else { &mut slot.1 }) = value;
                }
            }
        }
        Ok(out)
    }

    /// One `query_range` of `histogram_quantile(q, ...)`: per consumer, (time, milliseconds).
    async fn quantile_range(
        &self,
        q: f64,
        consumer: Option<&str>,
        width: Duration,
        start: i64,
        end: i64,
        step: u64,
    ) -> Result<Vec<(String, Vec<(f64, Option<f64>)>)>, String> {
        #[derive(Deserialize)]
        struct Answer {
            data: Data,
        }
        #[derive(Deserialize)]
        struct Data {
            result: Vec<Series>,
        }
        #[derive(Deserialize)]
        struct Series {
            metric: HashMap<String, String>,
            values: Vec<(f64, String)>,
        }
        let answer: Answer = self
            .get(
                "/api/v1/query_range",
                &[
                    ("query", quantile_query(q, consumer, width)),
                    ("start", start.to_string()),
                    ("end", end.to_string()),
                    ("step", step.to_string()),
                ],
            )
            .await?;
        Ok(answer
            .data
            .result
            .into_iter()
            .filter_map(|mut s| {
                let name = s.metric.remove("consumer")?;
                let points = s
                    .values
                    .into_iter()
                    .map(|(at, v)| {
                        // NaN: no deliveries in the range; +Inf: all above the last bucket.
                        let ms = v.parse::<f64>().ok().filter(|v| v.is_finite());
                        (at, ms.map(|s| s * 1000.0))
                    })
                    .collect();
                Some((name, points))
            })
            .collect())
    }
}

/// The PromQL for quantile `q` of [`LATENCY_HISTOGRAM`] per consumer, rated over the bucket.
fn quantile_query(q: f64, consumer: Option<&str>, width: Duration) -> String {
    let range = width.max(MIN_RATE_RANGE).as_secs();
    let selector = consumer
        .map(|c| format!("{{consumer=\"{}\"}}", escape_label(c)))
        .unwrap_or_default();
    format!(
        "histogram_quantile({q}, sum by (consumer, le) \
         (rate({LATENCY_HISTOGRAM}_bucket{selector}[{range}s])))"
    )
}

/// A label value as a PromQL double-quoted string's content.
fn escape_label(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_consumer_name_cannot_break_out_of_its_label_matcher() {
        let query = quantile_query(0.99, Some("a\"} or up{x=\"\\"), Duration::from_secs(60));
        assert_eq!(
            query,
            "histogram_quantile(0.99, sum by (consumer, le) \
             (rate(rabbit_inbox_delivery_to_settle_seconds_bucket\
             {consumer=\"a\\\"} or up{x=\\\"\\\\\"}[120s])))"
        );
        let wide = quantile_query(0.5, None, Duration::from_secs(900));
        assert!(wide.ends_with("_bucket[900s])))"), "{wide}");
    }
}
