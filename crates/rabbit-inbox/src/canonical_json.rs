//! A canonical JSON serialization, so that two bodies holding the same JSON value hash the
//! same however the producer wrote them (key order, whitespace, escapes, number forms).
//!
//! It follows RFC 8785 (JCS): no whitespace; object members sorted by their names' UTF-16
//! code units; strings escaped as ECMAScript's `JSON.stringify` does (only `"`, `\` and
//! control characters); floating-point numbers in ECMAScript's shortest round-trip form
//! (`1.0` and `1e0` become `1`, `1e21` stays `1e+21`). One deliberate difference: integers
//! that fit 64 bits are written exactly, where JCS would round them to a double first. JCS
//! would make two different ids above 2^53 (snowflake ids, say) hash alike, and a body that
//! really changed would pass as the same one.
//!
//! The output depends only on the value: not on the order a `serde_json::Map` iterates in
//! (which `serde_json`'s `preserve_order` feature changes), nor on how numbers are held
//! (`arbitrary_precision`).

use serde_json::{Number, Value};
use sha2::{Digest, Sha256};

/// The canonical serialization of `value`.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_value(value, &mut out);
    out
}

/// SHA-256 of the canonical serialization of `value`, without building it.
pub(crate) fn canonical_sha256(value: &Value) -> [u8; 32] {
    let mut hasher = Sha256::new();
    write_value(value, &mut hasher);
    hasher.finalize().into()
}

/// Feeds the canonical serialization of `value` to `hasher`.
pub(crate) fn hash_into(value: &Value, hasher: &mut Sha256) {
    write_value(value, hasher);
}

/// Where the serialization goes: a string, or straight into a hash.
trait Sink {
    fn put(&mut self, text: &str);
}

impl Sink for String {
    fn put(&mut self, text: &str) {
        self.push_str(text);
    }
}

impl Sink for Sha256 {
    fn put(&mut self, text: &str) {
        self.update(text.as_bytes());
    }
}

// Recursive: parsed values are at most 128 deep (serde_json's recursion limit).
fn write_value(value: &Value, out: &mut impl Sink) {
    match value {
        Value::Null => out.put("null"),
        Value::Bool(true) => out.put("true"),
        Value::Bool(false) => out.put("false"),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.put("[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.put(",");
                }
                write_value(item, out);
            }
            out.put("]");
        }
        Value::Object(map) => {
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.put("{");
            for (i, (name, member)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.put(",");
                }
                write_string(name, out);
                out.put(":");
                write_value(member, out);
            }
            out.put("}");
        }
    }
}

fn write_number(n: &Number, out: &mut impl Sink) {
    if let Some(u) = n.as_u64() {
        out.put(&u.to_string());
    } else if let Some(i) = n.as_i64() {
        out.put(&i.to_string());
    } else {
        match n.as_f64() {
            Some(f) if f.is_finite() => out.put(&ecmascript_number(f)),
            // Only reachable with `arbitrary_precision` (e.g. 1e400): keep the text as it is.
            _ => out.put(&n.to_string()),
        }
    }
}

/// ECMAScript's `Number::toString(x)` (ECMA-262, 6.1.6.1.20) for a finite `x`.
fn ecmascript_number(x: f64) -> String {
    if x == 0.0 {
        // Both zeros.
        return "0".to_owned();
    }
    // Rust prints the shortest digits that round-trip, closest to x: the digits ECMAScript
    // asks for. `{:e}` gives them as `d[.ddd]e<exp>`.
    let scientific = format!("{:e}", x.abs());
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let exponent: i32 = exponent.parse().unwrap_or(0);
    // x = 0.<digits> * 10^n, with k digits.
    let k = digits.len() as i32;
    let n = exponent + 1;
    let mut text = String::with_capacity(digits.len() + 8);
    if x < 0.0 {
        text.push('-');
    }
    if k <= n && n <= 21 {
        text.push_str(&digits);
        text.extend(std::iter::repeat_n('0', (n - k) as usize));
    } else if 0 < n && n <= 21 {
        let (int, frac) = digits.split_at(n as usize);
        text.push_str(int);
        text.push('.');
        text.push_str(frac);
    } else if -6 < n && n <= 0 {
        text.push_str("0.");
        text.extend(std::iter::repeat_n('0', (-n) as usize));
        text.push_str(&digits);
    } else {
        let (first, rest) = digits.split_at(1);
        text.push_str(first);
        if !rest.is_empty() {
            text.push('.');
            text.push_str(rest);
        }
        text.push('e');
        text.push(if n - 1 < 0 { '-' } else { '+' });
        text.push_str(&(n - 1).abs().to_string());
    }
    text
}

/// A string as `JSON.stringify` writes it: `"`, `\` and control characters escaped (the usual
/// short forms, else `\u00xx`), everything else as is.
fn write_string(s: &str, out: &mut impl Sink) {
    out.put("\"");
    let mut run_start = 0;
    for (i, c) in s.char_indices() {
        let short = match c {
            '"' => "\\\"",
            '\\' => "\\\\",
            '\u{8}' => "\\b",
            '\t' => "\\t",
            '\n' => "\\n",
            '\u{c}' => "\\f",
            '\r' => "\\r",
            c if c < ' ' => "",
            _ => continue,
        };
        out.put(&s[run_start..i]);
        if short.is_empty() {
            out.put(&format!("\\u{:04x}", c as u32));
        } else {
            out.put(short);
        }
        run_start = i + c.len_utf8();
    }
    out.put(&s[run_start..]);
    out.put("\"");
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn canonical(text: &str) -> String {
        canonical_json(&serde_json::from_str(text).expect("valid JSON"))
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        let a = canonical(r#"{"b":1,"a":{"y":[1,2],"x":null}}"#);
        let b = canonical("{ \"a\" : { \"x\" : null , \"y\" : [ 1 , 2 ] } ,\n\t\"b\" : 1 }");
        assert_eq!(a, b);
        assert_eq!(a, r#"{"a":{"x":null,"y":[1,2]},"b":1}"#);
    }

    #[test]
    fn number_forms_of_one_value_agree() {
        for text in ["1", "1.0", "1e0", "10e-1", "0.1e1", "1.000"] {
            assert_eq!(canonical(text), "1", "{text}");
        }
        assert_eq!(canonical("-0"), "0");
        assert_eq!(canonical("-0.0"), "0");
        assert_eq!(canonical("1e2"), "100");
        assert_eq!(canonical("2.50"), "2.5");
        assert_eq!(canonical("-1.5E3"), "-1500");
    }

    #[test]
    fn numbers_follow_ecmascript() {
        // Cases from RFC 8785, appendix B.
        let cases = [
            (0.0, "0"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (9007199254740992.0, "9007199254740992"),
            (295147905179352830000.0, "295147905179352830000"),
            (1e21, "1e+21"),
            (1e-7, "1e-7"),
            (0.000001, "0.000001"),
            (333333333.3333333, "333333333.3333333"),
            (-1.5, "-1.5"),
            (0.1 + 0.2, "0.30000000000000004"),
            (1e20, "100000000000000000000"),
            (123e-20, "1.23e-18"),
        ];
        for (x, want) in cases {
            assert_eq!(ecmascript_number(x), want, "{x:?}");
        }
    }

    #[test]
    fn integers_are_exact_beyond_two_to_the_53() {
        // Doubles cannot tell these apart; the canonical form must.
        assert_ne!(canonical("9007199254740993"), canonical("9007199254740992"));
        assert_eq!(canonical("9007199254740993"), "9007199254740993");
        assert_eq!(canonical("18446744073709551615"), "18446744073709551615");
        assert_eq!(canonical("-9223372036854775808"), "-9223372036854775808");
    }

    #[test]
    fn unicode_escapes_are_resolved() {
        assert_eq!(canonical(r#""\u00e9\u20ac""#), canonical("\"é€\""));
        assert_eq!(canonical(r#""\ud83d\ude00""#), "\"\u{1F600}\"");
        assert_eq!(canonical(r#""\/""#), r#""/""#);
        assert_eq!(canonical(r#""\u0041""#), r#""A""#);
        // Control characters keep their escapes; DEL and U+2028 do not need one.
        assert_eq!(
            canonical(r#""\u0001\b\t\n\f\r\"\\\u007f\u2028""#),
            "\"\\u0001\\b\\t\\n\\f\\r\\\"\\\\\u{7f}\u{2028}\""
        );
    }

    #[test]
    fn names_sort_by_utf16_code_units() {
        // U+FF61 sorts after U+1F600 in UTF-16 (a surrogate pair starts with 0xD83D), before
        // it by code point. RFC 8785, section 3.2.3, sorts this way too.
        let v = json!({"\u{ff61}": 1, "\u{1F600}": 2, "a": 3, "\r": 4, "1": 5, "\u{e9}": 6});
        assert_eq!(
            canonical_json(&v),
            "{\"\\r\":4,\"1\":5,\"a\":3,\"\u{e9}\":6,\"\u{1F600}\":2,\"\u{ff61}\":1}"
        );
    }

    #[test]
    fn different_values_differ() {
        let pairs = [
            (r#"{"a":1}"#, r#"{"a":2}"#),
            (r#"{"a":1}"#, r#"{"a":"1"}"#),
            (r#"[1,2]"#, r#"[2,1]"#),
            (r#"{"a":null}"#, r#"{}"#),
            (r#""a b""#, r#""ab""#),
            (r#"1.5"#, r#"1.25"#),
            (r#"{"ab":"c"}"#, r#"{"a":"bc"}"#),
        ];
        for (a, b) in pairs {
            assert_ne!(canonical(a), canonical(b), "{a} vs {b}");
        }
    }

    #[test]
    fn hash_is_of_the_canonical_text() {
        let v = json!({"z": [1.5, "x"], "a": true});
        let want: [u8; 32] = Sha256::digest(canonical_json(&v).as_bytes()).into();
        assert_eq!(canonical_sha256(&v), want);
    }

    #[test]
    fn canonical_text_parses_back_to_itself() {
        let v: Value =
            serde_json::from_str(r#"{"k":[0.1,-2e-9,1e300,12345678901234567890,"\u0000"]}"#)
                .expect("valid");
        let once = canonical_json(&v);
        let again = canonical(&once);
        assert_eq!(once, again);
    }
}
