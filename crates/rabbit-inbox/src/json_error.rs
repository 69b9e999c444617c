//! Error texts about producer JSON that never quote it.
//!
//! serde's messages quote the offending value (`invalid type: string "4111111111111111",
//! expected i64`), unknown variant and field names, and whatever a type's own check puts in a
//! custom message. These texts end up in `last_error_message`, in logs and on the admin API, so
//! they must not carry what the privacy policy keeps out of the payload column. What is kept:
//! the field path (map keys only when they look like field names), the kind of the value, what
//! the type expected, and for syntax errors the line and column.

use serde::de::DeserializeOwned;
use serde_json::{Value, error::Category};

/// Longest text taken over from the type's side of a message (what it expected).
const MAX_EXPECTED_CHARS: usize = 160;
/// Longest map key shown in a path.
const MAX_KEY_CHARS: usize = 64;

/// Deserializes `value` as `T`; on a mismatch, where and what went wrong without the value.
pub(crate) fn decode<T: DeserializeOwned>(value: &Value) -> Result<T, String> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = path_of(e.path());
        format!("at {path}: {}", describe(e.inner()))
    })
}

/// The kind of a JSON value, for messages that must not show the value.
pub(crate) fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// `path` as `items[0].email`; keys that do not look like field names (a map keyed by
/// producer data: card numbers, e-mail addresses) show as `<key>`. The root is `the document`.
fn path_of(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path.iter() {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(if looks_like_a_field_name(key) {
                    key
                } else {
                    "<key>"
                });
            }
            Segment::Unknown => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push('?');
            }
        }
    }
    if out.is_empty() {
        "the document".to_owned()
    } else {
        out
    }
}

/// An identifier a type would declare: starts with a letter or `_`, then letters, digits, `_`,
/// `-`, `$` or `@` (`@type`, `$ref`), bounded. A digit string (a card number used as a key) or
/// anything with a space, dot or `@` inside is not.
fn looks_like_a_field_name(key: &str) -> bool {
    let mut chars = key.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || matches!(c, '_' | '$' | '@'));
    first_ok
        && key.len() <= MAX_KEY_CHARS
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))
}

/// `e` without any producer data: its category, the shape of a data error, the position of a
/// syntax error.
pub(crate) fn describe(e: &serde_json::Error) -> String {
    let position = if e.line() > 0 {
        format!(" at line {} column {}", e.line(), e.column())
    } else {
        String::new()
    };
    match e.classify() {
        Category::Syntax => format!("invalid JSON{position}"),
        Category::Eof => format!("the JSON ends early{position}"),
        Category::Io => "the JSON could not be read".to_owned(),
        Category::Data => {
            let full = e.to_string();
            let message = full.strip_suffix(&position).unwrap_or(&full);
            format!("{}{position}", describe_data(message))
        }
    }
}

/// The shapes serde's default `de::Error` methods produce, rebuilt without the value.
fn describe_data(message: &str) -> String {
    if let Some(rest) = message.strip_prefix("invalid type: ") {
        return unexpected("invalid type", rest);
    }
    if let Some(rest) = message.strip_prefix("invalid value: ") {
        return unexpected("invalid value", rest);
    }
    if let Some(rest) = message.strip_prefix("invalid length ") {
        // `invalid length {usize}, expected {exp}`: the number is a length, not data.
        if let Some((len, expected)) = rest.split_once(", expected ")
            && len.chars().all(|c| c.is_ascii_digit())
        {
            return format!("invalid length {len}, expected {}", bounded(expected));
        }
        return "invalid length".to_owned();
    }
    for (prefix, what, none) in [
        (
            "unknown variant `",
            "unknown variant",
            "`, there are no variants",
        ),
        ("unknown field `", "unknown field", "`, there are no fields"),
    ] {
        if let Some(rest) = message.strip_prefix(prefix) {
            // The name between the backticks is the producer's; the list after it is the
            // type's.
            if let Some(at) = rest.rfind("`, expected ") {
                let name_chars = rest[..at].chars().count();
                let expected = &rest[at + "`, expected ".len()..];
                return format!(
                    "{what} ({name_chars} characters, not shown), expected {}",
                    bounded(expected)
                );
            }
            if rest.ends_with(none) {
                return format!("{what} (not shown), {}", &none[3..]);
            }
            return format!("{what} (not shown)");
        }
    }
    for prefix in ["missing field `", "duplicate field `"] {
        // The name is the type's own field (serde only reports fields it declares).
        if message.starts_with(prefix) && message.ends_with('`') {
            return bounded(message);
        }
    }
    // A type's own check (`de::Error::custom`): free text that may quote the value.
    "the value was refused by the type's own check (its message is not shown: it may quote \
     the value)"
        .to_owned()
}

/// `{what}: {unexpected}, expected {exp}` with the unexpected value reduced to its kind.
fn unexpected(what: &str, rest: &str) -> String {
    let Some(at) = rest.rfind(", expected ") else {
        return what.to_owned();
    };
    let (found, expected) = (&rest[..at], &rest[at + ", expected ".len()..]);
    // serde's `Unexpected` is a kind, then the value in backticks or quotes: keep the kind,
    // when it is one serde names.
    const KINDS: [&str; 17] = [
        "boolean",
        "integer",
        "floating point",
        "character",
        "string",
        "byte array",
        "unit value",
        "Option value",
        "newtype struct",
        "sequence",
        "map",
        "enum",
        "unit variant",
        "newtype variant",
        "tuple variant",
        "struct variant",
        "null",
    ];
    let kind = KINDS
        .iter()
        .find(|k| found == **k || found.starts_with(&format!("{k} ")))
        .copied()
        .unwrap_or("a value");
    format!("{what}: {kind}, expected {}", bounded(expected))
}

fn bounded(text: &str) -> String {
    if text.chars().count() <= MAX_EXPECTED_CHARS {
        text.to_owned()
    } else {
        let mut cut: String = text.chars().take(MAX_EXPECTED_CHARS).collect();
        cut.push('…');
        cut
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde::Deserialize;
    use serde_json::json;

    use super::*;

    const SECRET: &str = "4111111111111111";

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    struct Payment {
        amount: i64,
        currency: Currency,
        #[serde(default)]
        items: Vec<Item>,
    }

    #[derive(Debug, Deserialize)]
    #[allow(dead_code)]
    enum Currency {
        Eur,
        Usd,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Item {
        sku: String,
        pair: (u8, u8),
    }

    fn refusal<T: DeserializeOwned + std::fmt::Debug>(value: Value) -> String {
        let text = decode::<T>(&value).expect_err("refused");
        assert!(!text.contains(SECRET), "{text}");
        assert!(!text.contains("4111"), "{text}");
        text
    }

    #[test]
    fn invalid_type_names_the_path_and_the_kinds() {
        let text = refusal::<Payment>(json!({ "amount": SECRET, "currency": "Eur" }));
        assert_eq!(text, "at amount: invalid type: string, expected i64");
        let text = refusal::<Payment>(json!({ "amount": 1, "currency": "Eur",
            "items": [{ "sku": 4_111_111_111_111_111_u64, "pair": [1, 2] }] }));
        assert_eq!(
            text,
            "at items[0].sku: invalid type: integer, expected a string"
        );
    }

    #[test]
    fn invalid_value_keeps_the_kind_only() {
        let text = refusal::<Payment>(json!({ "amount": 1, "currency": "Eur",
            "items": [{ "sku": "a", "pair": [4111, 2] }] }));
        assert_eq!(
            text,
            "at items[0].pair[0]: invalid value: integer, expected u8"
        );
    }

    #[test]
    fn unknown_variant_and_unknown_field_hide_the_producer_name() {
        let text = refusal::<Payment>(json!({ "amount": 1, "currency": SECRET }));
        assert_eq!(
            text,
            "at currency: unknown variant (16 characters, not shown), expected `Eur` or `Usd`"
        );
        let text = refusal::<Payment>(json!({ "amount": 1, "currency": "Usd",
            "items": [{ "sku": "a", "pair": [1, 2], SECRET: true }] }));
        assert_eq!(
            text,
            "at items[0].<key>: unknown field (16 characters, not shown), expected `sku` or `pair`"
        );
    }

    #[test]
    fn missing_field_and_invalid_length_are_the_types_own_words() {
        let text = refusal::<Payment>(json!({ "currency": "Eur" }));
        assert_eq!(text, "at the document: missing field `amount`");
        let text = refusal::<Payment>(json!({ "amount": 1, "currency": "Eur",
            "items": [{ "sku": "a", "pair": [1, 2, 3] }] }));
        assert_eq!(
            text,
            "at items[0].pair: invalid length 3, expected fewer elements in array"
        );
    }

    #[test]
    fn map_keys_that_are_producer_data_are_not_shown() {
        let text = refusal::<BTreeMap<String, i64>>(json!({ SECRET: "x" }));
        assert_eq!(text, "at <key>: invalid type: string, expected i64");
        let text = refusal::<BTreeMap<String, i64>>(json!({ "a@b.example": "x" }));
        assert_eq!(text, "at <key>: invalid type: string, expected i64");
    }

    #[test]
    fn custom_messages_of_a_types_own_check_are_withheld() {
        #[derive(Debug)]
        struct Checked;
        impl<'de> Deserialize<'de> for Checked {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = String::deserialize(d)?;
                Err(serde::de::Error::custom(format!("bad card {s}")))
            }
        }
        let text = refusal::<Checked>(json!(SECRET));
        assert!(
            text.starts_with("at the document: the value was refused"),
            "{text}"
        );
    }

    #[test]
    fn syntax_errors_give_the_position_only() {
        for (body, want) in [
            (
                format!("{{\"card\": {SECRET}x}}"),
                "invalid JSON at line 1 column 26",
            ),
            (
                format!("{{\"card\": \"{SECRET}"),
                "the JSON ends early at line 1 column 26",
            ),
            (
                format!("{{\"card\": \"{SECRET}\\q\"}}"),
                "invalid JSON at line 1 column 28",
            ),
        ] {
            let e = serde_json::from_str::<Value>(&body).expect_err("invalid");
            assert_eq!(describe(&e), want, "{body}: {e}");
        }
        // A data error of a typed parse keeps its position too.
        let e = serde_json::from_str::<Payment>(&format!("{{\"amount\": \"{SECRET}\"}}"))
            .expect_err("mismatch");
        assert_eq!(
            describe(&e),
            "invalid type: string, expected i64 at line 1 column 29"
        );
    }
}
