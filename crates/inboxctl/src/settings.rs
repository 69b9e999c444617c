//! Settings that describe the installation, from a TOML file: the file's values become the
//! defaults of the flags that have an environment variable, so a flag beats its variable, the
//! variable beats the file, and the file beats the built-in default.
//!
//! A key is the flag's environment variable without `INBOX_`, in lower case: `schema`
//! (`INBOX_SCHEMA`), `retry_delays` (`INBOX_RETRY_DELAYS`), `database_url` (`DATABASE_URL`).
//! A flag without a variable (an actor's reason, a message id) is not a setting, and has no key.

use std::{
    collections::BTreeSet,
    ffi::{OsStr, OsString},
    path::{Path, PathBuf},
};

use anyhow::{Context, anyhow, bail};
use clap::{Arg, ArgAction, Command};

/// The flag that names the file.
pub const CONFIG_FLAG: &str = "--config";
/// The variable that names the file when the flag does not.
pub const CONFIG_ENV: &str = "INBOXCTL_CONFIG";
/// The file read, when neither names one, if the working directory holds it.
pub const DEFAULT_CONFIG_FILE: &str = "inboxctl.toml";

/// A settings file, read and parsed.
#[derive(Debug)]
pub struct SettingsFile {
    path: PathBuf,
    values: toml::Table,
}

impl SettingsFile {
    /// The file named by `--config` in `args` (the command line, program name first), else by
    /// `INBOXCTL_CONFIG`, else `inboxctl.toml` if the working directory holds one; `None` when
    /// there is none. A file named by the flag or the variable must exist.
    pub fn find(args: &[OsString]) -> anyhow::Result<Option<Self>> {
        let named = config_flag(args).or_else(|| {
            std::env::var_os(CONFIG_ENV)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        });
        match named {
            Some(path) => Self::read(&path).map(Some),
            None if Path::new(DEFAULT_CONFIG_FILE).is_file() => {
                Self::read(Path::new(DEFAULT_CONFIG_FILE)).map(Some)
            }
            None => Ok(None),
        }
    }

    /// Reads and parses the file at `path`.
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "cannot read the settings file {} (named by {CONFIG_FLAG}, {CONFIG_ENV}, or \
                 found as ./{DEFAULT_CONFIG_FILE})",
                path.display()
            )
        })?;
        Self::parse(path, &text)
    }

    /// Parses `text`, the contents of the file at `path`.
    pub fn parse(path: &Path, text: &str) -> anyhow::Result<Self> {
        let values: toml::Table = toml::from_str(text)
            .map_err(|e| anyhow!("{} is not valid TOML: {e}", path.display()))?;
        Ok(Self {
            path: path.to_owned(),
            values,
        })
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `command` with the file's values as the defaults of the flags they set, in every
    /// subcommand. An error names the file and the key when a key sets no flag or a value is
    /// not one its flag takes.
    pub fn apply(&self, command: Command) -> anyhow::Result<Command> {
        let mut keys = BTreeSet::new();
        collect_keys(&command, &mut keys);
        let mut values = Vec::with_capacity(self.values.len());
        for (key, value) in &self.values {
            if !keys.contains(key.as_str()) {
                bail!(
                    "{}: unknown key `{key}`; the keys are: {}",
                    self.path.display(),
                    keys.iter().cloned().collect::<Vec<_>>().join(", ")
                );
            }
            let value = strings(value).ok_or_else(|| {
                anyhow!(
                    "{}: key `{key}`: expected a string, a number, a boolean or an array of \
                     them, found {}",
                    self.path.display(),
                    value.type_str()
                )
            })?;
            values.push((key.clone(), value));
        }
        let mut errors = Vec::new();
        let command = set_defaults(command, &values, &mut errors);
        match errors.into_iter().next() {
            Some((key, message)) => Err(anyhow!("{}: key `{key}`: {message}", self.path.display())),
            None => Ok(command),
        }
    }
}

/// The file's key for a flag read from the environment variable `env`.
pub fn key_of(env: &OsStr) -> String {
    let env = env.to_string_lossy();
    env.strip_prefix("INBOX_")
        .unwrap_or(&env)
        .to_ascii_lowercase()
}

/// The path given to `--config` on the command line, if any (before a `--`).
fn config_flag(args: &[OsString]) -> Option<PathBuf> {
    let mut args = args.iter().skip(1).take_while(|a| *a != "--");
    while let Some(arg) = args.next() {
        if arg == CONFIG_FLAG {
            return args.next().map(PathBuf::from);
        }
        let rest = arg
            .to_str()
            .and_then(|a| a.strip_prefix(CONFIG_FLAG)?.strip_prefix('='));
        if let Some(path) = rest {
            return Some(PathBuf::from(path));
        }
    }
    None
}

/// The keys of every flag of `command` and its subcommands that has an environment variable.
fn collect_keys(command: &Command, keys: &mut BTreeSet<String>) {
    for arg in command.get_arguments() {
        if let Some(env) = arg.get_env()
            && env != CONFIG_ENV
        {
            keys.insert(key_of(env));
        }
    }
    for sub in command.get_subcommands() {
        collect_keys(sub, keys);
    }
}

/// A TOML value as the strings a flag would be given; `None` for tables and dates.
fn strings(value: &toml::Value) -> Option<Vec<String>> {
    match value {
        toml::Value::Array(items) => items
            .iter()
            .map(|item| match item {
                toml::Value::Array(_) => None,
                item => strings(item).and_then(|mut s| s.pop()),
            })
            .collect(),
        toml::Value::String(s) => Some(vec![s.clone()]),
        toml::Value::Integer(i) => Some(vec![i.to_string()]),
        toml::Value::Float(f) => Some(vec![f.to_string()]),
        toml::Value::Boolean(b) => Some(vec![b.to_string()]),
        toml::Value::Datetime(_) | toml::Value::Table(_) => None,
    }
}

/// `command` with `values` as the defaults of the flags they name, here and in every
/// subcommand; what a flag's parser refuses goes to `errors`, as (key, message).
fn set_defaults(
    command: Command,
    values: &[(String, Vec<String>)],
    errors: &mut Vec<(String, String)>,
) -> Command {
    let command = command.mut_args(|arg| {
        let Some(key) = arg.get_env().filter(|e| *e != CONFIG_ENV).map(key_of) else {
            return arg;
        };
        let Some((_, value)) = values.iter().find(|(k, _)| *k == key) else {
            return arg;
        };
        if let Err(message) = check(&arg, value) {
            errors.push((key, message));
            return arg;
        }
        // A default does not count as given, so a required flag must stop being required.
        arg.default_values(value.clone()).required(false)
    });
    command.mut_subcommands(|sub| set_defaults(sub, values, errors))
}

/// Whether `arg` takes `value`, split at its delimiter as clap splits a default; the parser's
/// complaint if not. The value is parsed by a lone copy of the flag, without its variable or
/// its relations to other flags.
fn check(arg: &Arg, value: &[String]) -> Result<(), String> {
    let long = arg.get_long().unwrap_or("value").to_owned();
    let probe = Arg::new(arg.get_id())
        .long(long.clone())
        .value_parser(arg.get_value_parser().clone())
        .value_delimiter(arg.get_value_delimiter())
        .allow_hyphen_values(true)
        .action(ArgAction::Append);
    let command = Command::new("inboxctl").no_binary_name(true).arg(probe);
    for item in value {
        if let Err(e) = command
            .clone()
            .try_get_matches_from([format!("--{long}={item}")])
        {
            let text = e.to_string();
            let first = text.lines().next().unwrap_or_default();
            return Err(first.strip_prefix("error: ").unwrap_or(first).to_owned());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command() -> Command {
        Command::new("inboxctl")
            .arg(
                Arg::new("database_url")
                    .long("database-url")
                    .env("DATABASE_URL"),
            )
            .subcommand(
                Command::new("doctor")
                    .arg(
                        Arg::new("schema")
                            .long("schema")
                            .env("INBOX_SCHEMA")
                            .required(true),
                    )
                    .arg(
                        Arg::new("max_attempts")
                            .long("max-attempts")
                            .env("INBOX_MAX_ATTEMPTS")
                            .value_parser(clap::value_parser!(i32))
                            .default_value("5"),
                    )
                    .arg(
                        Arg::new("retry_delays")
                            .long("retry-delays")
                            .env("INBOX_RETRY_DELAYS")
                            .value_delimiter(',')
                            .action(ArgAction::Append),
                    )
                    .arg(Arg::new("reason").long("reason")),
            )
    }

    fn file(text: &str) -> SettingsFile {
        SettingsFile::parse(Path::new("site.toml"), text).expect("valid TOML")
    }

    #[test]
    fn keys_are_the_variables_without_the_prefix() {
        assert_eq!(key_of(OsStr::new("INBOX_RETRY_DELAYS")), "retry_delays");
        assert_eq!(key_of(OsStr::new("DATABASE_URL")), "database_url");
    }

    #[test]
    fn the_config_flag_is_found_in_both_spellings_before_a_double_dash() {
        let args = |a: &[&str]| a.iter().map(OsString::from).collect::<Vec<_>>();
        assert_eq!(
            config_flag(&args(&["inboxctl", "status", "--config", "a.toml"])),
            Some(PathBuf::from("a.toml"))
        );
        assert_eq!(
            config_flag(&args(&["inboxctl", "--config=b.toml", "status"])),
            Some(PathBuf::from("b.toml"))
        );
        assert_eq!(
            config_flag(&args(&["inboxctl", "show", "--", "--config"])),
            None
        );
    }

    #[test]
    fn the_file_fills_what_the_command_line_leaves_out() {
        let file = file(
            "schema = \"billing\"\nmax_attempts = 9\nretry_delays = [\"1s\", \"5s,30s\"]\n\
             database_url = \"postgres://db/x\"\n",
        );
        let command = file.apply(command()).expect("known keys");
        let matches = command
            .try_get_matches_from(["inboxctl", "doctor", "--max-attempts", "3"])
            .expect("the schema is no longer required");
        assert_eq!(
            matches
                .get_one::<String>("database_url")
                .map(String::as_str),
            Some("postgres://db/x")
        );
        let (_, doctor) = matches.subcommand().expect("doctor");
        assert_eq!(
            doctor.get_one::<String>("schema").map(String::as_str),
            Some("billing")
        );
        assert_eq!(
            doctor.get_one::<i32>("max_attempts"),
            Some(&3),
            "the flag wins"
        );
        let delays: Vec<&String> = doctor
            .get_many::<String>("retry_delays")
            .expect("delays")
            .collect();
        assert_eq!(delays, ["1s", "5s", "30s"]);
    }

    #[test]
    fn unknown_keys_and_refused_values_name_the_file_and_the_key() {
        let err = file("schema = \"billing\"\nreason = \"why\"\n")
            .apply(command())
            .expect_err("reason is no setting");
        let text = err.to_string();
        assert!(
            text.starts_with("site.toml: unknown key `reason`"),
            "{text}"
        );
        assert!(
            text.contains("max_attempts, retry_delays, schema"),
            "{text}"
        );

        let err = file("max_attempts = \"many\"\n")
            .apply(command())
            .expect_err("not a number");
        let text = err.to_string();
        assert!(
            text.starts_with("site.toml: key `max_attempts`: "),
            "{text}"
        );
        assert!(text.contains("'many'"), "{text}");

        let err = file("[doctor]\nschema = \"billing\"\n")
            .apply(command())
            .expect_err("no sections");
        assert!(err.to_string().contains("unknown key `doctor`"), "{err}");
    }
}
