//! AMQP header tables to JSON (for envelopes and the inbox row) and back (for publishing).

use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use serde_json::{Map, Number, Value};

use crate::error::BrokerError;

pub(super) fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// AMQP header table to JSON. Byte arrays become hex strings, decimals numbers, timestamps
/// Unix seconds; strings that are not UTF-8 are converted lossily.
pub(crate) fn table_to_json(table: &FieldTable) -> Map<String, Value> {
    table
        .inner()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), value_to_json(v)))
        .collect()
}

/// The header conversion applied to every delivery, exposed for fuzzing.
#[doc(hidden)]
pub fn headers_to_json(table: &FieldTable) -> Map<String, Value> {
    table_to_json(table)
}

fn value_to_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(n) => Value::from(*n),
        AMQPValue::ShortShortUInt(n) => Value::from(*n),
        AMQPValue::ShortInt(n) => Value::from(*n),
        AMQPValue::ShortUInt(n) => Value::from(*n),
        AMQPValue::LongInt(n) => Value::from(*n),
        AMQPValue::LongUInt(n) => Value::from(*n),
        AMQPValue::LongLongInt(n) => Value::from(*n),
        AMQPValue::Float(f) => Number::from_f64(f64::from(*f)).map_or(Value::Null, Value::Number),
        AMQPValue::Double(f) => Number::from_f64(*f).map_or(Value::Null, Value::Number),
        AMQPValue::DecimalValue(d) => {
            Number::from_f64(f64::from(d.value) / 10f64.powi(i32::from(d.scale)))
                .map_or(Value::Null, Value::Number)
        }
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_owned()),
        AMQPValue::LongString(s) => {
            Value::String(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_to_json).collect()),
        AMQPValue::Timestamp(t) => Value::from(*t),
        AMQPValue::FieldTable(t) => Value::Object(table_to_json(t)),
        AMQPValue::ByteArray(b) => Value::String(hex::encode(b.as_slice())),
        AMQPValue::Void => Value::Null,
    }
}

/// JSON to an AMQP header table (for publishing).
/// `text` as an AMQP short string. `ShortString::from` panics past 255 bytes; a producer
/// handing us a long id or header name gets an error instead.
pub(super) fn short(what: &str, text: &str) -> Result<ShortString, BrokerError> {
    ShortString::try_new(text).map_err(|_| BrokerError::TooLong {
        what: what.to_owned(),
        len: text.len(),
    })
}

pub(crate) fn json_to_table(map: &Map<String, Value>) -> Result<FieldTable, BrokerError> {
    let mut table = FieldTable::default();
    for (k, v) in map {
        let name = short(&format!("header name {:?}", truncate_chars(k, 40)), k)?;
        table.insert(name, json_to_value(v)?);
    }
    Ok(table)
}

/// The first `n` characters of `s`, for error messages.
fn truncate_chars(s: &str, n: usize) -> &str {
    s.char_indices().nth(n).map_or(s, |(i, _)| &s[..i])
}

/// A JSON container being converted, with the AMQP values of its children so far.
enum Open<'a> {
    Array(std::slice::Iter<'a, Value>, Vec<AMQPValue>),
    /// The table, and the name of the child being converted.
    Table(serde_json::map::Iter<'a>, FieldTable, Option<ShortString>),
}

/// JSON to an AMQP value, iteratively: a producer's header may nest thousands of levels
/// (bounded only by the frame size), and a recursive conversion would overflow the stack.
fn json_to_value(root: &Value) -> Result<AMQPValue, BrokerError> {
    let mut stack: Vec<Open<'_>> = Vec::new();
    let mut finished = open(root, &mut stack);
    loop {
        let Some(top) = stack.last_mut() else {
            return Ok(finished.unwrap_or(AMQPValue::Void));
        };
        if let Some(child) = finished.take() {
            match top {
                Open::Array(_, values) => values.push(child),
                Open::Table(_, table, name) => {
                    if let Some(name) = name.take() {
                        table.insert(name, child);
                    }
                }
            }
        }
        let next = match top {
            Open::Array(children, _) => children.next(),
            Open::Table(children, _, name) => match children.next() {
                Some((k, v)) => {
                    *name = Some(short(
                        &format!("header name {:?}", truncate_chars(k, 40)),
                        k,
                    )?);
                    Some(v)
                }
                None => None,
            },
        };
        match next {
            Some(child) => finished = open(child, &mut stack),
            None => {
                finished = stack.pop().map(|done| match done {
                    Open::Array(_, values) => AMQPValue::FieldArray(FieldArray::from(values)),
                    Open::Table(_, table, _) => AMQPValue::FieldTable(table),
                });
            }
        }
    }
}

/// A scalar's AMQP value, or `None` after pushing a container onto `stack`.
fn open<'a>(v: &'a Value, stack: &mut Vec<Open<'a>>) -> Option<AMQPValue> {
    Some(match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => AMQPValue::LongLongInt(i),
            (None, Some(f)) => AMQPValue::Double(f),
            (None, None) => long_string(&n.to_string()),
        },
        Value::String(s) => long_string(s),
        Value::Array(a) => {
            stack.push(Open::Array(a.iter(), Vec::with_capacity(a.len())));
            return None;
        }
        Value::Object(o) => {
            stack.push(Open::Table(o.iter(), FieldTable::default(), None));
            return None;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn headers_round_trip_through_amqp_values() {
        let headers = json!({
            "s": "text", "i": -3, "f": 1.5, "b": true, "n": null,
            "a": [1, "two"], "t": {"nested": {"deep": 1}}
        });
        let map = headers.as_object().cloned().unwrap_or_default();
        assert_eq!(
            table_to_json(&json_to_table(&map).expect("short names")),
            map
        );
    }

    #[test]
    fn deep_json_headers_convert_without_recursion() {
        // Far deeper than a recursive conversion survives on a 2 MB test thread.
        let depth = 50_000;
        // Built by hand: `json!` would serialize (recursively) the value it wraps.
        let mut deep = Value::from(1);
        for i in 0..depth {
            deep = if i % 2 == 0 {
                Value::Array(vec![deep])
            } else {
                Value::Object(Map::from_iter([("t".to_owned(), deep)]))
            };
        }
        let mut map = Map::new();
        map.insert("deep".into(), deep);
        let table = json_to_table(&map).expect("short names");
        let mut levels = 0;
        let mut at = table.inner().get("deep");
        while let Some(v) = at {
            at = match v {
                AMQPValue::FieldArray(a) => a.as_slice().first(),
                AMQPValue::FieldTable(t) => t.inner().get("t"),
                _ => None,
            };
            levels += 1;
        }
        assert_eq!(levels, depth + 1);
        // Both values are deep: dropping them recursively would overflow too.
        std::mem::forget(table);
        std::mem::forget(map);
    }

    #[test]
    fn odd_amqp_values_become_json() {
        let mut t = FieldTable::default();
        t.insert(
            "bytes".into(),
            AMQPValue::ByteArray(vec![0xde, 0xad].into()),
        );
        t.insert(
            "dec".into(),
            AMQPValue::DecimalValue(lapin::types::DecimalValue {
                scale: 2,
                value: 150,
            }),
        );
        t.insert(
            "bad".into(),
            AMQPValue::LongString(LongString::from(vec![0xff, b'a'])),
        );
        let j = table_to_json(&t);
        assert_eq!(j["bytes"], "dead");
        assert_eq!(j["dec"], 1.5);
        assert_eq!(j["bad"], "\u{fffd}a");
    }
}
