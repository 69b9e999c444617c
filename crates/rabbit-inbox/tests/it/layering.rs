//! The core's modules form layers that only point down (ARCHITECTURE.md): each module
//! imports only modules listed before it here. The list is the architecture; a new import
//! that runs back up fails this test, naming the file and the import.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

/// Bottom to top. A module may use the ones before it, never the ones after.
const LAYERS: &[&str] = &[
    // Leaves: errors, canonical JSON, retry budget, schema names and migrations.
    "error",
    "canonical_json",
    "json_error",
    "db_error",
    "backoff",
    "advisory_lock",
    "retry",
    "schema",
    // The state machine's vocabulary.
    "status",
    // Its words as SQL: the ledger's tables, status sets and shared conditions.
    "ledger_sql",
    // What a message is, what is kept of it, what is counted.
    "dedup",
    "roles",
    "retention",
    "envelope",
    "telemetry",
    "privacy",
    "session_loss",
    "stats",
    "health",
    // The ledger and the broker, side by side.
    "store",
    "broker",
    // The outbox, then what application code implements.
    "outbox",
    "handler",
    "router",
    "config",
    // The runtime.
    "processor",
    "lease",
    "fault",
    "consumer",
    // The consumer's path without a broker, for applications' handler tests.
    "testing",
    // Beside the runtime, never inside it.
    "runner",
    "sampler",
];

/// Pairs that the order alone would allow but the architecture does not: the processor and
/// leased processing turn batches into durable outcomes without speaking to the broker (only
/// the settler acts on outcomes), background work is run beside the runtime, not by it, and
/// the test kit reports broker actions as data without a broker.
const FORBIDDEN: &[(&str, &str)] = &[
    ("processor", "broker"),
    ("lease", "broker"),
    ("consumer", "sampler"),
    ("consumer", "runner"),
    ("testing", "broker"),
];

/// Modules named by `crate::<name>` in `source`, outside comments and the unit tests.
fn imported_modules(source: &str, modules: &BTreeSet<&str>) -> BTreeSet<String> {
    let code: String = source
        .split("\n#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or_default()
        .lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = BTreeSet::new();
    // `crate::a::b` and `crate::a`.
    for (i, _) in code.match_indices("crate::") {
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // `use crate::{a::x, b, c::{..}}`: the first segment of each top-level item.
            let (mut depth, mut item, mut items) = (0, String::new(), Vec::new());
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => items.push(std::mem::take(&mut item)),
                    _ if depth == 0 => item.push(c),
                    _ => {}
                }
            }
            items.push(item);
            found.extend(items.iter().filter_map(|it| first_segment(it)));
        } else if let Some(name) = first_segment(rest) {
            found.insert(name);
        }
    }
    found.retain(|m| modules.contains(m.as_str()));
    found
}

fn first_segment(path: &str) -> Option<String> {
    let name: String = path
        .trim_start()
        .chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_')
        .collect();
    (!name.is_empty()).then_some(name)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("readable source directory") {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn the_core_modules_import_only_the_layers_below_them() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let modules: BTreeSet<&str> = LAYERS.iter().copied().collect();
    let rank: BTreeMap<&str, usize> = LAYERS.iter().enumerate().map(|(i, m)| (*m, i)).collect();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut upward = Vec::new();
    let mut seen = BTreeSet::new();
    for file in &files {
        let relative = file.strip_prefix(&src).expect("under src");
        let top = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .map(|s| s.trim_end_matches(".rs"))
            .expect("a file name");
        if top == "lib" {
            continue;
        }
        let Some(&own) = rank.get(top) else {
            panic!(
                "module {top} ({}) is in no layer: add it to LAYERS",
                relative.display()
            );
        };
        seen.insert(top.to_owned());
        let source = fs::read_to_string(file).expect("readable source");
        for imported in imported_modules(&source, &modules) {
            if imported != top && rank[imported.as_str()] > own {
                upward.push(format!("{} imports crate::{imported}", relative.display()));
            }
            if FORBIDDEN.contains(&(top, imported.as_str())) {
                upward.push(format!(
                    "{} imports crate::{imported}, which its layer must not use",
                    relative.display()
                ));
            }
        }
    }
    assert!(
        upward.is_empty(),
        "imports that run back up:\n{}",
        upward.join("\n")
    );
    let listed_but_absent: Vec<_> = LAYERS.iter().filter(|m| !seen.contains(**m)).collect();
    assert!(
        listed_but_absent.is_empty(),
        "listed modules without a file: {listed_but_absent:?}"
    );
}

#[test]
fn the_import_scanner_sees_grouped_and_plain_paths() {
    let modules: BTreeSet<&str> = ["a", "b", "c", "d"].into_iter().collect();
    let source = "use crate::{a::X, b, c::{Y, d::Z}};\n// crate::d in a comment\nfn f() { crate::d::g(); }\n";
    let found = imported_modules(source, &modules);
    assert_eq!(
        found,
        ["a", "b", "c", "d"].into_iter().map(String::from).collect()
    );
    assert!(imported_modules("// only crate::a here", &modules).is_empty());
}
