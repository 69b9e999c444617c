//! `inbox-lab soak`: the example service at a steady rate for a set time, reporting resident
//! memory and delivery-to-ack latency per interval; fails if memory keeps growing or the
//! stream does not end exactly-once.

use std::{
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Args;
use rabbit_inbox::{Consumer, SchemaName};

use crate::{Servers, clean_slate, scenario::Scenario};

/// The soak run's settings.
#[derive(Args, Debug)]
pub struct SoakArgs {
    /// Messages published per second.
    #[arg(long, default_value_t = 500)]
    rate: u32,
    /// How long to publish, in seconds.
    #[arg(long, default_value_t = 300)]
    duration_secs: u64,
    /// Length of one reporting interval, in seconds.
    #[arg(long, default_value_t = 10)]
    interval_secs: u64,
    /// Resident memory may grow by at most this share over the second interval's figure
    /// (the first interval includes warm-up).
    #[arg(long, default_value_t = 0.25)]
    max_memory_growth: f64,
    /// Seed of the stream; printed, so a run can be replayed.
    #[arg(long)]
    seed: Option<u64>,
    /// PostgreSQL schema of the run (dropped and recreated at the start, kept afterwards).
    #[arg(long, default_value = "inbox_soak")]
    schema: String,
    /// Work queue of the run (recreated at the start, with `.retry` and `.parking-lot`).
    #[arg(long, default_value = "inbox-soak")]
    queue: String,
}

/// Resident memory of this process in MiB (`VmRSS`), 0 where /proc is not available.
fn resident_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Whether memory stayed bounded: the last interval within `max_growth` of the baseline
/// (the second interval, or the first when there is only one).
fn memory_bounded(samples: &[f64], max_growth: f64) -> bool {
    let Some(&last) = samples.last() else {
        return true;
    };
    let baseline = samples.get(1).or(samples.first()).copied().unwrap_or(last);
    last <= baseline * (1.0 + max_growth)
}

/// The soak run; exit code 1 if memory keeps growing or effects are not exactly-once.
pub async fn run(servers: &Servers, args: SoakArgs) -> anyhow::Result<ExitCode> {
    if args.rate == 0 || args.interval_secs == 0 {
        anyhow::bail!("--rate and --interval-secs must be at least 1");
    }
    let schema = SchemaName::new(&args.schema)?;
    let exchange = format!("{}.orders", args.queue);
    let config = order_service::config(schema.clone(), &args.queue, &exchange);
    let topology = config.topology.clone();
    let retry = config.retry.clone();
    let seed = args.seed.unwrap_or_else(rand::random);

    let (pool, broker) = clean_slate(servers, &config).await?;

    // About the whole duration at the rate (3.3 messages per order, about).
    let wanted = u64::from(args.rate) * args.duration_secs;
    let scenario = Scenario::generate((wanted as f64 / 3.3).ceil().max(1.0) as usize, seed);
    let messages = &scenario.messages;
    println!(
        "rabbit-inbox soak: seed {seed}, {} msgs/s for {} s ({} messages), intervals of {} s",
        args.rate,
        args.duration_secs,
        messages.len(),
        args.interval_secs
    );

    let handler = order_service::OrderHandler::new(schema.clone());
    let consumer = Consumer::new(servers.amqp_url.clone(), pool.clone(), config, handler)?;
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consuming = tokio::spawn(consumer.run(async {
        let _ = stopped.await;
    }));

    println!(
        "  {:>7}  {:>9}  {:>9}  {:>7}  {:>7}  {:>7}  {:>8}",
        "t (s)", "published", "settled", "msgs/s", "p50 ms", "p99 ms", "RSS MiB"
    );
    let began = Instant::now();
    let interval = Duration::from_secs(args.interval_secs);
    // Every 10 ms, whatever is due by then goes out as one confirmed batch: a confirm per
    // message would cap the rate at one broker round trip per message.
    let mut ticker = tokio::time::interval(Duration::from_millis(10));
    let mut next_report = began + interval;
    let mut settled_before = 0;
    let mut memory = Vec::new();
    let mut published = 0usize;
    let report = |published: usize, settled_before: &mut u64, memory: &mut Vec<f64>| {
        let s = stats.snapshot();
        let settled = stats.settled();
        let rss = resident_mb();
        memory.push(rss);
        println!(
            "  {:>7.0}  {:>9}  {:>9}  {:>7.0}  {:>7.1}  {:>7.1}  {:>8.1}",
            began.elapsed().as_secs_f64(),
            published,
            settled,
            (settled - *settled_before) as f64 / interval.as_secs_f64(),
            s.latency_p50.as_secs_f64() * 1000.0,
            s.latency_p99.as_secs_f64() * 1000.0,
            rss
        );
        *settled_before = settled;
        // Percentiles per interval, not since the start.
        stats.reset_latency();
    };
    while published < messages.len() {
        ticker.tick().await;
        let due =
            ((began.elapsed().as_secs_f64() * f64::from(args.rate)) as usize).min(messages.len());
        if due > published {
            let batch: Vec<_> = messages[published..due]
                .iter()
                .map(|m| (m.routing_key.as_str(), &m.message))
                .collect();
            broker
                .publish_batch(&exchange, &batch)
                .await
                .context("publishing")?;
            published = due;
        }
        if Instant::now() >= next_report {
            report(published, &mut settled_before, &mut memory);
            next_report += interval;
        }
        if consuming.is_finished() {
            break;
        }
    }

    // Let the tail (retries included) settle.
    let deadline = Instant::now() + Duration::from_secs(60);
    let unique = scenario.unique_keys as i64;
    let settled = loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let v = order_service::verify(&pool, &schema).await?;
        let depths = broker.queue_depths(&topology, &retry).await?;
        if v.processed + v.parked == unique
            && v.retryable == 0
            && v.processing == 0
            && depths.work == 0
            && depths.retry == 0
        {
            break true;
        }
        if Instant::now() > deadline || consuming.is_finished() {
            break false;
        }
    };
    report(published, &mut settled_before, &mut memory);
    let _ = stop.send(());
    match consuming.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e).context("the consumer stopped with an error"),
        Err(e) => return Err(anyhow::anyhow!("the consumer task failed: {e}")),
    }
    broker.close().await;
    let v = order_service::verify(&pool, &schema).await?;

    let checks = [
        ("every message published", published == messages.len()),
        ("settled within 60 s of the last publish", settled),
        ("effects exactly once", v.exactly_once()),
        (
            "resident memory bounded",
            memory_bounded(&memory, args.max_memory_growth),
        ),
    ];
    println!();
    for (name, pass) in &checks {
        println!("  [{}] {name}", if *pass { " ok " } else { "FAIL" });
    }
    if checks.iter().all(|(_, pass)| *pass) {
        println!("soak: OK (seed {seed})");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("soak: FAILED; replay with --seed {seed}; inspect schema {schema}");
        Ok(ExitCode::FAILURE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_growth_is_judged_against_the_warmed_up_interval() {
        // Warm-up in the first interval does not count.
        assert!(memory_bounded(&[20.0, 60.0, 62.0, 61.0], 0.25));
        // Steady growth after warm-up does.
        assert!(!memory_bounded(&[20.0, 60.0, 70.0, 80.0], 0.25));
        assert!(memory_bounded(&[], 0.25));
        assert!(memory_bounded(&[50.0], 0.0));
    }

    #[test]
    fn resident_memory_is_read() {
        assert!(resident_mb() > 0.0);
    }
}
