//! What the kernel says about processes (Linux `/proc`): this process's peak resident memory,
//! and CPU time of this process, PostgreSQL and RabbitMQ, to show where a run's time goes.
//! Readings are 0 where `/proc` is unavailable.
//!
//! A process's reading includes the CPU time of its children that have exited and been
//! reaped (`cutime`, `cstime`): a PostgreSQL backend that ends during a run (the consumer's
//! lane connections close when it stops) moves its time into the postmaster's, so it is still
//! counted instead of vanishing from `/proc` between the two readings.

/// Resets the kernel's peak-RSS mark, so the next reading covers only what follows.
pub(crate) fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// Peak resident memory since the last reset, in MiB.
pub(crate) fn peak_mb() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// CPU time used so far, in clock ticks, by this process, by all `postgres` processes and by
/// RabbitMQ (`beam.smp`), each with its reaped children.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CpuTicks {
    pub(crate) consumer: u64,
    pub(crate) postgres: u64,
    pub(crate) broker: u64,
}

/// Clock ticks per second of `/proc/*/stat` (USER_HZ, 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

impl CpuTicks {
    pub(crate) fn now() -> Self {
        let own = std::process::id();
        let mut t = CpuTicks::default();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return t;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            let Some((comm, ticks)) = stat(pid) else {
                continue;
            };
            if pid == own {
                t.consumer += ticks;
            } else if comm == "postgres" {
                t.postgres += ticks;
            } else if comm == "beam.smp" {
                t.broker += ticks;
            }
        }
        t
    }

    /// CPU milliseconds per 1000 messages between `earlier` and `self`.
    pub(crate) fn per_thousand(self, earlier: CpuTicks, messages: usize) -> CpuShare {
        let ms = |now: u64, then: u64| {
            (now.saturating_sub(then) as f64) / TICKS_PER_SECOND * 1000.0 * 1000.0
                / messages.max(1) as f64
        };
        CpuShare::new(
            ms(self.consumer, earlier.consumer),
            ms(self.postgres, earlier.postgres),
            ms(self.broker, earlier.broker),
        )
    }
}

/// CPU milliseconds per 1000 messages, by process group.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct CpuShare {
    /// This process (the consumer under test).
    pub consumer: f64,
    /// PostgreSQL backends and background processes.
    pub postgres: f64,
    /// RabbitMQ.
    pub broker: f64,
    /// The three together.
    pub total: f64,
}

impl CpuShare {
    /// The shares and their total.
    pub fn new(consumer: f64, postgres: f64, broker: f64) -> Self {
        Self {
            consumer,
            postgres,
            broker,
            total: consumer + postgres + broker,
        }
    }
}

/// Cores of this machine, for how busy a run kept them.
pub(crate) fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64)
}

/// `comm` and utime + stime + cutime + cstime of one process.
fn stat(pid: u32) -> Option<(String, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    let comm = text.get(open + 1..close)?.to_owned();
    // Fields after the command: state is field 3; utime, stime, cutime and cstime are fields
    // 14 to 17 (the children's are signed in the kernel's format).
    let rest: Vec<&str> = text.get(close + 2..)?.split_whitespace().collect();
    let field = |i: usize| -> Option<u64> {
        let v: i64 = rest.get(i)?.parse().ok()?;
        Some(u64::try_from(v).unwrap_or(0))
    };
    Some((comm, field(11)? + field(12)? + field(13)? + field(14)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_cpu_time() {
        let (comm, _) = stat(std::process::id()).expect("own stat");
        assert!(!comm.is_empty());
        let before = CpuTicks::now();
        let mut x = 0u64;
        for i in 0..50_000_000u64 {
            x = x.wrapping_add(i * i);
        }
        std::hint::black_box(x);
        let after = CpuTicks::now();
        assert!(after.consumer >= before.consumer);
    }

    #[test]
    fn a_child_that_exits_still_counts_in_its_parent() {
        let before = stat(std::process::id()).expect("own stat").1;
        // About half a second of shell arithmetic in a child, which then exits and is reaped.
        let status = std::process::Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done"])
            .status()
            .expect("sh runs");
        assert!(status.success());
        let after = stat(std::process::id()).expect("own stat").1;
        // At least 100 ms of the child's CPU time, in 10 ms ticks.
        assert!(
            after.saturating_sub(before) >= 10,
            "the exited child's CPU time is missing: {before} -> {after} ticks"
        );
    }
}
