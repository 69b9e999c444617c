//! Settings from a TOML file (`--config`, `INBOXCTL_CONFIG`, `./inboxctl.toml`): the file's
//! values are used, a variable beats the file, a flag beats the variable, and a wrong file is
//! refused with its name and the key.

use std::{
    path::{Path, PathBuf},
    process::Output,
};

use inbox_testkit::unique_suffix;
use rabbit_inbox::SchemaName;

use crate::common::{Cleanup, command};

/// A directory of the test's own, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("inboxctl-settings-{}", unique_suffix()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }

    /// Writes `text` to `name` in the directory; its path.
    fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("settings file written");
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `inboxctl args` in `dir`, with the variables in `env` set.
async fn run_in(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut command = command();
    command.current_dir(dir).args(args);
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().await.expect("inboxctl runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The schema `grants` printed its statements for (it needs no server).
fn granted_schema(out: &Output) -> String {
    assert!(out.status.success(), "{}", stderr(out));
    let text = stdout(out);
    let first = text.lines().next().unwrap_or_default();
    first
        .rsplit_once(" on schema ")
        .map(|(_, schema)| schema.to_owned())
        .unwrap_or_else(|| panic!("no schema in {text}"))
}

const GRANTS: [&str; 5] = ["grants", "--role", "consumer", "--grantee", "app"];

#[tokio::test]
async fn a_setting_comes_from_the_file_unless_a_variable_or_a_flag_gives_it() {
    let dir = TempDir::new();
    let file = dir.file("billing.toml", "schema = \"from_file\"\n");
    let file = file.to_string_lossy();
    let with_config = |extra: &'static [&'static str]| {
        let mut args = vec!["--config", &*file];
        args.extend(GRANTS);
        args.extend_from_slice(extra);
        args.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let args = with_config(&[]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();

    let out = run_in(&dir.0, &[], &args).await;
    assert_eq!(granted_schema(&out), "from_file");

    let out = run_in(&dir.0, &[("INBOX_SCHEMA", "from_env")], &args).await;
    assert_eq!(
        granted_schema(&out),
        "from_env",
        "a variable beats the file"
    );

    let flagged = with_config(&["--schema", "from_flag"]);
    let flagged: Vec<&str> = flagged.iter().map(String::as_str).collect();
    let out = run_in(&dir.0, &[("INBOX_SCHEMA", "from_env")], &flagged).await;
    assert_eq!(
        granted_schema(&out),
        "from_flag",
        "a flag beats the variable"
    );

    // Without the file (nor a variable) the schema is missing, as before.
    let out = run_in(&dir.0, &[], &GRANTS).await;
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--schema"), "{}", stderr(&out));
}

#[tokio::test]
async fn the_file_is_found_through_inboxctl_config_or_in_the_working_directory() {
    let dir = TempDir::new();
    dir.file("inboxctl.toml", "schema = \"from_working_dir\"\n");
    let named = dir.file("named.toml", "schema = \"from_named_file\"\n");

    let out = run_in(&dir.0, &[], &GRANTS).await;
    assert_eq!(granted_schema(&out), "from_working_dir");

    let named = named.to_string_lossy();
    let out = run_in(&dir.0, &[("INBOXCTL_CONFIG", &named)], &GRANTS).await;
    assert_eq!(granted_schema(&out), "from_named_file");

    let missing = dir.0.join("missing.toml");
    let missing = missing.to_string_lossy();
    let mut args = vec!["--config", &*missing];
    args.extend(GRANTS);
    let out = run_in(&dir.0, &[], &args).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains(&*missing), "{}", stderr(&out));
}

#[tokio::test]
async fn an_unknown_key_or_a_bad_value_is_refused_naming_the_key_and_the_file() {
    let dir = TempDir::new();
    let unknown = dir.file(
        "unknown.toml",
        "schema = \"billing\"\nretry_delay = \"1s,5s\"\n",
    );
    let unknown = unknown.to_string_lossy();
    let mut args = vec!["--config", &*unknown];
    args.extend(GRANTS);
    let out = run_in(&dir.0, &[], &args).await;
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("unknown key `retry_delay`"), "{err}");
    assert!(err.contains(&*unknown), "{err}");
    assert!(
        err.contains("retry_delays"),
        "the known keys are listed: {err}"
    );

    let bad = dir.file(
        "bad.toml",
        "schema = \"billing\"\nmax_attempts = \"many\"\n",
    );
    let bad = bad.to_string_lossy();
    let mut args = vec!["--config", &*bad];
    args.extend(GRANTS);
    let out = run_in(&dir.0, &[], &args).await;
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("key `max_attempts`"), "{err}");
    assert!(err.contains("many"), "{err}");
    assert!(err.contains(&*bad), "{err}");

    let not_toml = dir.file("broken.toml", "schema = \n");
    let not_toml = not_toml.to_string_lossy();
    let mut args = vec!["--config", &*not_toml];
    args.extend(GRANTS);
    let out = run_in(&dir.0, &[], &args).await;
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains(&*not_toml), "{}", stderr(&out));
}

#[tokio::test]
async fn help_shows_the_file_values_as_defaults() {
    let dir = TempDir::new();
    dir.file(
        "inboxctl.toml",
        "retry_delays = \"2s,20s\"\nmax_attempts = 9\nprocessed_retention = \"60days\"\n",
    );
    let out = run_in(&dir.0, &[], &["doctor", "--help"]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let help = stdout(&out);
    assert!(help.contains("[default: 2s,20s]"), "{help}");
    assert!(help.contains("[default: 9]"), "{help}");
    assert!(help.contains("[default: 60days]"), "{help}");
    assert!(help.contains("INBOX_RETRY_DELAYS"), "{help}");
}

/// Against the servers: the file's database URL is used when no variable gives one, and the
/// variable wins over it; the schema comes from the file in both runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_database_url_of_the_file_is_used_and_the_variable_beats_it() {
    let schema = SchemaName::new(format!("t_settings_{}", unique_suffix())).expect("schema");
    let _cleanup = Cleanup::schema(schema.as_str());
    let dir = TempDir::new();
    // Nothing listens on port 1: a run that reads this URL fails, naming the address.
    dir.file(
        "inboxctl.toml",
        &format!(
            "schema = \"{schema}\"\ndatabase_url = \"postgres://postgres@127.0.0.1:1/postgres\"\n"
        ),
    );

    let mut from_file = command();
    from_file
        .current_dir(&dir.0)
        .env_remove("DATABASE_URL")
        .arg("migrate");
    let out = from_file.output().await.expect("inboxctl runs");
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    assert!(stderr(&out).contains("127.0.0.1:1"), "{}", stderr(&out));

    // `command()` sets DATABASE_URL to the test server.
    let out = run_in(&dir.0, &[], &["migrate"]).await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!("schema {schema} is up to date")),
        "{}",
        stdout(&out)
    );
}
