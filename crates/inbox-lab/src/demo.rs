//! `inbox-lab demo`: the end-to-end run of the example service against the local servers.

use std::{
    io::{IsTerminal, Write},
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::Context;
use clap::Args;
use rabbit_inbox::{Consumer, SchemaName};

use inbox_chaos::{clean_slate, publish_all, scenario::Scenario};

use crate::{Servers, log_capture::LogCapture};

#[derive(Args)]
pub(crate) struct DemoArgs {
    /// Orders in the stream (about 3.4 messages each, with duplicates and poison).
    #[arg(long, default_value_t = 1000)]
    orders: usize,
    /// Seed of the stream; printed, so a run can be replayed.
    #[arg(long)]
    seed: Option<u64>,
    /// PostgreSQL schema of the demo (dropped and recreated at the start; kept afterwards
    /// for inspection).
    #[arg(long, default_value = "inbox_demo")]
    schema: String,
    /// Work queue of the demo (recreated at the start, with `.retry` and `.parking-lot`).
    #[arg(long, default_value = "inbox-demo")]
    queue: String,
    /// Deliveries per transaction [default: the library's]
    #[arg(long)]
    batch_size: Option<usize>,
    /// Transactions in flight [default: the library's]
    #[arg(long)]
    lanes: Option<usize>,
    /// Unacked deliveries the broker may push [default: the library's]
    #[arg(long)]
    prefetch: Option<u16>,
    /// Give up waiting for the stream to settle after this many seconds.
    #[arg(long, default_value_t = 180)]
    timeout_secs: u64,
}

pub(crate) async fn run(
    servers: &Servers,
    args: DemoArgs,
    log: Option<&LogCapture>,
) -> anyhow::Result<ExitCode> {
    let schema = SchemaName::new(&args.schema)?;
    let exchange = format!("{}.orders", args.queue);
    let mut config = order_service::config(schema.clone(), &args.queue, &exchange);
    config.batch_size = args.batch_size.unwrap_or(config.batch_size);
    config.lanes = args.lanes.unwrap_or(config.lanes);
    config.prefetch = args.prefetch.unwrap_or(config.prefetch);
    config.validate()?;
    let seed = args.seed.unwrap_or_else(rand::random);

    let (pool, broker) = clean_slate(servers, &config).await?;

    let scenario = Scenario::generate(args.orders, seed);
    println!(
        "rabbit-inbox demo: seed {seed}, {} orders, batch {} x {} lanes, prefetch {}",
        args.orders, config.batch_size, config.lanes, config.prefetch
    );
    let started = Instant::now();
    publish_all(&broker, &exchange, &scenario.messages).await?;
    println!(
        "published {} messages ({} unique, {} exact duplicates, {} payments before their order) in {:.1} s",
        scenario.messages.len(),
        scenario.unique_keys,
        scenario.duplicates,
        scenario.out_of_order,
        started.elapsed().as_secs_f64()
    );

    let handler = order_service::OrderHandler::new(schema.clone());
    let consumer = Consumer::new(
        servers.amqp_url.clone(),
        pool.clone(),
        config.clone(),
        handler,
    )?;
    consumer
        .faults()
        .drop_connection_after_commit_of(scenario.crash_after_commit_of.clone());
    let faults = consumer.faults();
    let stats = consumer.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let consuming = tokio::spawn(consumer.run(async {
        let _ = stopped.await;
    }));

    let published = scenario.messages.len() as u64;
    let consume_start = Instant::now();
    let mut first_pass: Option<Duration> = None;
    let deadline = consume_start + Duration::from_secs(args.timeout_secs);
    // Redraw one progress line on a terminal; print one every few seconds into logs.
    let interactive = std::io::stderr().is_terminal();
    let mut last_line = Instant::now();
    let settled = loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let s = stats.snapshot();
        if first_pass.is_none() && s.received >= published {
            first_pass = Some(consume_start.elapsed());
        }
        let v = order_service::verify(&pool, &schema).await?;
        let depths = broker.queue_depths(&config.topology, &config.retry).await?;
        let line = format!(
            "  consuming: {:>6} deliveries, {:>6} processed, {:>4} retried, {:>3} parked, retry queue {:>3} ",
            s.received, v.processed, s.retried, v.parked, depths.retry
        );
        if interactive {
            eprint!("\r{line}");
            let _ = std::io::stderr().flush();
        } else if last_line.elapsed() >= Duration::from_secs(2) {
            eprintln!("{line}");
            last_line = Instant::now();
        }
        let all_final = v.processed + v.parked == scenario.unique_keys as i64
            && v.retryable == 0
            && v.processing == 0;
        if all_final && depths.work == 0 && depths.retry == 0 {
            break true;
        }
        if consuming.is_finished() || Instant::now() > deadline {
            break false;
        }
    };
    if interactive {
        eprintln!();
    }
    let total_time = consume_start.elapsed();
    let _ = stop.send(());
    match consuming.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e).context("the consumer stopped with an error"),
        Err(e) => return Err(anyhow::anyhow!("the consumer task failed: {e}")),
    }

    let s = stats.snapshot();
    let v = order_service::verify(&pool, &schema).await?;
    let depths = broker.queue_depths(&config.topology, &config.retry).await?;
    broker.close().await;
    let e = &scenario.expected;
    let first_pass = first_pass.unwrap_or(total_time);
    let rate = published as f64 / first_pass.as_secs_f64().max(1e-9);

    let checks = [
        (
            "every unique message PROCESSED or parked",
            settled
                && v.retryable == 0
                && v.processing == 0
                && v.processed + v.parked == scenario.unique_keys as i64,
        ),
        ("no payment applied twice", v.double_applied == 0),
        (
            "every PROCESSED payment applied, none without a ledger entry",
            v.ledger_without_effect == 0 && v.effects_without_ledger == 0,
        ),
        (
            "paid totals equal the sum of payment rows",
            v.paid_mismatches == 0,
        ),
        ("payments applied as expected", v.payment_rows == e.payments),
        ("orders created as expected", v.orders == e.orders),
        ("parked rows as expected", v.parked == e.parked_rows),
        (
            "parking lot holds every parked message",
            i64::from(depths.parking) >= e.parked_rows + e.conflicts,
        ),
        (
            "crash between commit and ack injected",
            faults.pending() == 0 && s.sessions >= 2,
        ),
    ];
    let ok = checks.iter().all(|(_, pass)| *pass);

    println!();
    println!("  {:<44} {:>10}", "messages published", published);
    println!("  {:<44} {:>10}", "unique messages", scenario.unique_keys);
    println!("  {:<44} {:>10}", "deliveries received", s.received);
    println!(
        "  {:<44} {:>10}",
        "processed (PROCESSED rows in the inbox)", v.processed
    );
    println!(
        "  {:<44} {:>10}",
        "duplicates suppressed (acked, not applied)", s.duplicates
    );
    println!(
        "  {:<44} {:>10}",
        "retried through the retry queue", s.retried
    );
    println!(
        "  {:<44} {:>10}",
        "parked rows (PERMANENT_FAILED / POISONED)", v.parked
    );
    println!(
        "  {:<44} {:>10}",
        "messages in the parking lot", depths.parking
    );
    println!(
        "  {:<44} {:>10}",
        "broker sessions (1 + reconnects)", s.sessions
    );
    println!("  {:<44} {:>10}", "payments applied (rows)", v.payment_rows);
    println!(
        "  {:<44} {:>10.0}  ({} deliveries in {:.2} s)",
        "throughput, first pass (msgs/s)",
        rate,
        published,
        first_pass.as_secs_f64()
    );
    println!(
        "  {:<44} {:>10.1}",
        "until settled, retries included (s)",
        total_time.as_secs_f64()
    );
    if let Some(log) = log {
        println!();
        for line in log.summary() {
            println!("  {line}");
        }
    }
    println!();
    for (name, pass) in &checks {
        println!("  [{}] {name}", if *pass { " ok " } else { "FAIL" });
    }
    println!();
    if ok {
        println!("exactly-once: OK (counted from the database in schema {schema})");
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "exactly-once: FAILED; inspect schema {schema} and queue {}.parking-lot (seed {seed})",
            args.queue
        );
        Ok(ExitCode::FAILURE)
    }
}
