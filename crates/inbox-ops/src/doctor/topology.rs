//! Broker checks: the topology as the broker has it, read through the management API.

use serde_json::Value;

use super::{
    check::{Area, Check, Severity},
    check_ids as ids,
    request::DoctorRequest,
};
use crate::{
    management::{ManagementClient, ManagementError, QueueInfo},
    operations::Operations,
};
use rabbit_inbox::{broker::QueueType, broker::Topology};

/// Values of a queue setting as text for a detail line.
fn shown(value: &Value) -> String {
    match value {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

/// One finding about a queue.
struct Problem(Severity, String);

/// What is wrong with one queue's dead-letter route to `target`.
fn dead_letter_problems(q: &QueueInfo, target: &str, quorum: bool, out: &mut Vec<Problem>) {
    let name = &q.name;
    match q.setting("dead-letter-exchange") {
        None => out.push(Problem(
            Severity::Fail,
            format!("{name} has no dead-letter exchange (expected the default exchange \"\")"),
        )),
        Some(s) if s.value != "" => out.push(Problem(
            Severity::Fail,
            format!(
                "{name} dead-letters to exchange {} ({}), expected the default exchange \"\"",
                shown(&s.value),
                s.source
            ),
        )),
        Some(_) => {}
    }
    match q.setting("dead-letter-routing-key") {
        None => out.push(Problem(
            Severity::Fail,
            format!("{name} has no dead-letter routing key (expected {target:?})"),
        )),
        Some(s) if s.value != target => out.push(Problem(
            Severity::Fail,
            format!(
                "{name} dead-letters with routing key {} ({}), expected {target:?}",
                shown(&s.value),
                s.source
            ),
        )),
        Some(_) => {}
    }
    if quorum {
        // At-most-once (the quorum default) drops a message its target does not take.
        let strategy = q.setting("dead-letter-strategy");
        if strategy.as_ref().is_none_or(|s| s.value != "at-least-once") {
            out.push(Problem(
                Severity::Fail,
                format!(
                    "{name} dead-letters at most once ({}): a message the target does not take \
                     is dropped; expected x-dead-letter-strategy at-least-once",
                    strategy.map_or("not set".to_owned(), |s| shown(&s.value))
                ),
            ));
        }
        let overflow = q.setting("overflow");
        if overflow
            .as_ref()
            .is_none_or(|s| s.value != "reject-publish")
        {
            out.push(Problem(
                Severity::Fail,
                format!(
                    "{name} overflow is {}: RabbitMQ honours at-least-once dead-lettering only \
                     with reject-publish",
                    overflow.map_or("not set (drop-head)".to_owned(), |s| shown(&s.value))
                ),
            ));
        }
    }
}

fn type_problem(q: &QueueInfo, expected: QueueType, out: &mut Vec<Problem>) {
    let want = match expected {
        QueueType::Classic => "classic",
        QueueType::Quorum => "quorum",
        // A type this doctor does not know: reported as a mismatch, never passed.
        _ => "a type this doctor does not know",
    };
    if q.queue_type != want {
        out.push(Problem(
            Severity::Fail,
            format!("{} is a {} queue, configured {want}", q.name, q.queue_type),
        ));
    }
}

/// A check row from the problems found (pass when none).
fn queue_check(id: &'static str, ok: String, problems: Vec<Problem>, hint: &str) -> Check {
    let Some(worst) = problems.iter().map(|p| p.0).max() else {
        return Check::pass(id, Area::Broker, ok);
    };
    let summary = problems
        .iter()
        .find(|p| p.0 == worst)
        .map(|p| p.1.clone())
        .unwrap_or_default();
    let detail = problems
        .iter()
        .map(|p| format!("{}: {}", p.0.as_str(), p.1))
        .collect::<Vec<_>>()
        .join("; ");
    Check::new(id, Area::Broker, worst, summary)
        .detail(if problems.len() > 1 {
            detail
        } else {
            String::new()
        })
        .hint(hint)
}

impl Operations {
    pub(super) async fn check_topology(&self, request: &DoctorRequest) -> Vec<Check> {
        let (Some(amqp_url), Some(topology)) = (&request.amqp_url, &request.topology) else {
            return vec![
                Check::new(
                    ids::TOPOLOGY,
                    Area::Broker,
                    Severity::Warn,
                    "broker topology not checked: no work queue given",
                )
                .hint("give the consumer's work queue (inboxctl doctor --queue <queue>)"),
            ];
        };
        let not_checked = |why: String| {
            vec![
                Check::new(
                    ids::TOPOLOGY,
                    Area::Broker,
                    Severity::Warn,
                    "broker topology not checked: the management API did not answer",
                )
                .detail(why)
                .hint(
                    "enable the management plugin (rabbitmq-plugins enable rabbitmq_management; \
                     port 15672) or give its URL (--management-url http://user:pass@host:15672)",
                ),
            ]
        };
        let client = match ManagementClient::new(amqp_url, request.management_url.as_deref()) {
            Ok(c) => c,
            Err(e) => return not_checked(e.to_string()),
        };
        let version = match client.broker_version().await {
            Ok(v) => v,
            Err(e) => return not_checked(e.to_string()),
        };
        match self
            .read_topology(&client, &version, topology, request)
            .await
        {
            Ok(rows) => rows,
            Err(e) => not_checked(e.to_string()),
        }
    }

    pub(super) async fn read_topology(
        &self,
        client: &ManagementClient,
        version: &str,
        topology: &Topology,
        request: &DoctorRequest,
    ) -> Result<Vec<Check>, ManagementError> {
        let quorum = topology.queue_type == QueueType::Quorum;
        let tiers = topology.retry_tier_queues(&request.retry);
        let first_tier = tiers.first().map_or(topology.retry_queue.as_str(), |t| t);
        let declare_hint = "start the consumer (it declares its topology) after removing the \
                            wrongly declared queue, or fix the policy that overrides it";
        let mut rows = Vec::new();

        let mut problems = Vec::new();
        match client.queue(&topology.queue).await? {
            None => problems.push(Problem(
                Severity::Fail,
                format!("work queue {} does not exist", topology.queue),
            )),
            Some(q) => {
                type_problem(&q, topology.queue_type, &mut problems);
                dead_letter_problems(&q, first_tier, quorum, &mut problems);
                if quorum {
                    let budget =
                        i64::from(request.retry.max_attempts) + i64::from(request.prefetch);
                    // RabbitMQ 4 limits quorum queues to 20 deliveries when nothing is set;
                    // 3.x does not limit them.
                    let limit = match q.setting("delivery-limit") {
                        Some(s) => s.value.as_i64().map(|l| (l, s.source)),
                        None if !version.starts_with('3') => Some((20, "default".into())),
                        None => None,
                    };
                    if let Some((limit, source)) = limit
                        && limit >= 0
                        && limit <= budget
                    {
                        problems.push(Problem(
                            Severity::Fail,
                            format!(
                                "{} delivery limit {limit} ({source}) does not exceed max \
                                 attempts + prefetch = {budget}: healthy messages would be \
                                 dead-lettered",
                                q.name
                            ),
                        ));
                    }
                }
            }
        }
        rows.push(queue_check(
            ids::WORK_QUEUE,
            format!(
                "work queue {} dead-letters to {first_tier} (RabbitMQ {version})",
                topology.queue
            ),
            problems,
            declare_hint,
        ));

        let mut problems = Vec::new();
        for (tier, delay) in tiers.iter().zip(&request.retry.delays) {
            let Some(q) = client.queue(tier).await? else {
                problems.push(Problem(
                    Severity::Fail,
                    format!("retry tier {tier} does not exist: its retries are lost"),
                ));
                continue;
            };
            type_problem(&q, topology.queue_type, &mut problems);
            match q.setting("message-ttl") {
                None => problems.push(Problem(
                    Severity::Fail,
                    format!("{tier} has no message TTL: retries wait there forever"),
                )),
                Some(s) => {
                    let want = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX);
                    if s.value.as_u64() != Some(want) {
                        problems.push(Problem(
                            Severity::Warn,
                            format!(
                                "{tier} TTL is {} ms ({}), configured {want} ms",
                                shown(&s.value),
                                s.source
                            ),
                        ));
                    }
                }
            }
            dead_letter_problems(&q, &topology.queue, quorum, &mut problems);
        }
        rows.push(queue_check(
            ids::RETRY_TIERS,
            format!(
                "{} retry tier(s) expire back into {}",
                tiers.len(),
                topology.queue
            ),
            problems,
            declare_hint,
        ));

        let mut problems = Vec::new();
        match client.queue(&topology.parking_queue).await? {
            None => problems.push(Problem(
                Severity::Fail,
                format!(
                    "parking lot {} does not exist: parked messages are lost",
                    topology.parking_queue
                ),
            )),
            Some(q) => {
                type_problem(&q, topology.queue_type, &mut problems);
                for key in [
                    "message-ttl",
                    "expires",
                    "max-length",
                    "dead-letter-exchange",
                ] {
                    if let Some(s) = q.setting(key) {
                        problems.push(Problem(
                            Severity::Warn,
                            format!(
                                "parking lot {} has {key} {} ({}): parked messages may leave it \
                                 before an operator looks",
                                q.name,
                                shown(&s.value),
                                s.source
                            ),
                        ));
                    }
                }
            }
        }
        rows.push(queue_check(
            ids::PARKING_LOT,
            format!("parking lot {} exists", topology.parking_queue),
            problems,
            declare_hint,
        ));
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    fn quorum_queue(arguments: Value) -> QueueInfo {
        QueueInfo {
            name: "orders".into(),
            queue_type: "quorum".into(),
            arguments: arguments.as_object().cloned().unwrap_or_default(),
            policy: None,
            effective_policy: serde_json::Map::new(),
        }
    }

    #[test]
    fn quorum_dead_lettering_must_be_at_least_once_with_reject_publish() {
        let declared = quorum_queue(serde_json::json!({
            "x-queue-type": "quorum",
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "orders.retry.1s",
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        }));
        let mut problems = Vec::new();
        dead_letter_problems(&declared, "orders.retry.1s", true, &mut problems);
        type_problem(&declared, QueueType::Quorum, &mut problems);
        assert!(
            problems.is_empty(),
            "{:?}",
            problems.iter().map(|p| &p.1).collect::<Vec<_>>()
        );

        let at_most_once = quorum_queue(serde_json::json!({
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "orders.retry.1s",
        }));
        dead_letter_problems(&at_most_once, "orders.retry.1s", true, &mut problems);
        type_problem(&at_most_once, QueueType::Classic, &mut problems);
        let found: Vec<&str> = problems.iter().map(|p| p.1.as_str()).collect();
        assert_eq!(problems.len(), 3, "{found:?}");
        assert!(problems.iter().all(|p| p.0 == Severity::Fail));
        assert!(found[0].contains("at most once") && found[1].contains("overflow"));
        assert!(found[2].contains("configured classic"));
    }
}
