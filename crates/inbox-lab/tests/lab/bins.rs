//! The two binaries under test. Cargo builds this package's `inbox-lab` for its tests; the
//! operator tool is another package's binary, built on first use when a test runs alone.

use std::{
    path::{Path, PathBuf},
    sync::OnceLock,
};

pub(crate) fn inbox_lab() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_inbox-lab"))
}

/// `inboxctl` from the same target directory, built once if missing (as under
/// `cargo test -p inbox-lab`; a workspace run builds it anyway).
pub(crate) fn inboxctl() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let bin = inbox_lab().with_file_name(format!("inboxctl{}", std::env::consts::EXE_SUFFIX));
        if !bin.exists() {
            let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
            let status = std::process::Command::new(cargo)
                .args(["build", "-p", "inboxctl"])
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .status()
                .expect("cargo runs");
            assert!(status.success(), "cargo build -p inboxctl failed");
        }
        assert!(bin.exists(), "{} was not built", bin.display());
        bin
    })
}

/// The binary that has `command`: the lab's example consumers and stream tools, or the
/// operator tool.
pub(crate) fn with_command(command: &str) -> &'static Path {
    match command {
        "consume" | "consume-shipping" | "publish" | "verify" | "demo" | "bench" | "chaos"
        | "soak" => inbox_lab(),
        _ => inboxctl(),
    }
}
