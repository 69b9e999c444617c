//! The console's one list of the inbox statuses (`assets/js/statuses.js`) against the core's
//! [`InboxStatus`]: the same names, the same one processed, the same ones parked.

use std::collections::BTreeMap;

use rabbit_inbox::InboxStatus;

/// Reads a file of the workspace, relative to this crate.
fn source(path: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The console's table: each `["NAME", "meaning"],` line of the module's `TABLE`, in order.
fn console_statuses() -> Vec<(String, String)> {
    let module = source("assets/js/statuses.js");
    let (_, rest) = module
        .split_once("const TABLE = [\n")
        .expect("a status table in statuses.js");
    let (rows, _) = rest.split_once("];").expect("the table's end");
    let table: Vec<(String, String)> = rows
        .lines()
        .filter_map(|line| {
            let entry = line.trim().strip_prefix("[\"")?.strip_suffix("\"],")?;
            let (name, meaning) = entry.split_once("\", \"")?;
            Some((name.to_owned(), meaning.to_owned()))
        })
        .collect();
    assert_eq!(
        table.len(),
        rows.lines().count(),
        "one status per line: {rows}"
    );
    table
}

/// The core's statuses, in their order: `InboxStatus::ALL`, which a compile-time match in
/// the core keeps complete.
fn core_statuses() -> Vec<&'static str> {
    InboxStatus::ALL.iter().map(|s| s.as_str()).collect()
}

#[test]
fn the_consoles_statuses_are_the_cores() {
    let console = console_statuses();
    let names: Vec<&str> = console.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(
        names,
        core_statuses(),
        "statuses.js lists the core's statuses, in its order"
    );
    let mut meanings = BTreeMap::new();
    for (name, meaning) in &console {
        let status: InboxStatus = name.parse().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(status.as_str(), name);
        let want = if status == InboxStatus::Processed {
            "processed"
        } else if status.is_parked() {
            "parked"
        } else {
            "in progress"
        };
        assert_eq!(meaning, want, "{name}");
        *meanings.entry(meaning.as_str()).or_insert(0) += 1;
    }
    assert_eq!(meanings.get("processed"), Some(&1), "{meanings:?}");
}

/// Only the status module spells a status: the page and the other modules take them from it.
#[test]
fn no_other_console_file_spells_a_status() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/js");
    let mut files: Vec<String> = std::fs::read_dir(&dir)
        .expect("the modules' directory")
        .map(|entry| {
            format!(
                "assets/js/{}",
                entry.expect("an entry").file_name().display()
            )
        })
        .filter(|file| file != "assets/js/statuses.js")
        .collect();
    files.push("assets/index.html".to_owned());
    for file in files {
        let text = source(&file);
        for name in core_statuses() {
            assert!(
                !text.contains(&format!("\"{name}")) && !text.contains(&format!(">{name}")),
                "{file} spells {name}"
            );
        }
    }
}
