//! AMQP header tables to JSON (for envelopes and the inbox row) and back (for publishing).

use lapin::types::{
    AMQPValue, FieldArray, FieldTable, LongString, ShortString, parsing::NESTED_TOO_DEEP,
};
use serde_json::{Map, Number, Value};

use crate::{
    envelope::{HEADER_TOO_DEEP, MAX_HEADER_DEPTH},
    error::BrokerError,
};

pub(super) fn long_string(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// AMQP header table to JSON, with the reason the headers are incomplete when a value nested
/// deeper than [`MAX_HEADER_DEPTH`] was replaced by [`HEADER_TOO_DEEP`]. Byte arrays become hex
/// strings, decimals numbers, timestamps Unix seconds; strings that are not UTF-8 are converted
/// lossily. The recursion is bounded by [`MAX_HEADER_DEPTH`].
pub(crate) fn table_to_json(table: &FieldTable) -> (Map<String, Value>, Option<String>) {
    let mut too_deep = None;
    let headers = table
        .inner()
        .iter()
        .map(|(k, v)| {
            let mut cut = false;
            let json = value_to_json(v, 2, &mut cut);
            if cut && too_deep.is_none() {
                too_deep = Some(format!(
                    "header {:?} nests field tables or arrays deeper than {MAX_HEADER_DEPTH} \
                     levels (the headers table included); the deeper part is omitted",
                    truncate_chars(k.as_str(), 40)
                ));
            }
            (k.as_str().to_owned(), json)
        })
        .collect();
    (headers, too_deep)
}

/// The header conversion applied to every delivery, from the headers table as AMQP encodes
/// it (a 4-byte length, then the entries), exposed for fuzzing and tests: the JSON headers and
/// why they are incomplete, if they are (see [`table_to_json`]). It parses with the same bounded
/// parser deliveries go through; `None` when `encoded` is not exactly one field table.
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub fn convert_encoded_headers(encoded: &[u8]) -> Option<(Map<String, Value>, Option<String>)> {
    match lapin::types::parsing::parse_field_table(encoded) {
        Ok(([], table)) => Some(table_to_json(&table)),
        _ => None,
    }
}

/// Whether `v` stands for a value nested too deep: the patched parser's marker (a short-string
/// value, which no wire type decodes to), or a table or array at a level past the bound.
fn too_deep(v: &AMQPValue, level: usize) -> bool {
    match v {
        AMQPValue::ShortString(s) => s.as_str() == NESTED_TOO_DEEP,
        AMQPValue::FieldArray(_) | AMQPValue::FieldTable(_) => level > MAX_HEADER_DEPTH,
        _ => false,
    }
}

/// `v` as JSON; `level` is the nesting level `v` has if it is a table or array. Sets `cut`
/// when a value nested too deep was replaced.
fn value_to_json(v: &AMQPValue, level: usize, cut: &mut bool) -> Value {
    if too_deep(v, level) {
        *cut = true;
        return Value::String(HEADER_TOO_DEEP.to_owned());
    }
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
        AMQPValue::FieldArray(a) => Value::Array(
            a.as_slice()
                .iter()
                .map(|x| value_to_json(x, level + 1, cut))
                .collect(),
        ),
        AMQPValue::Timestamp(t) => Value::from(*t),
        AMQPValue::FieldTable(t) => Value::Object(
            t.inner()
                .iter()
                .map(|(k, x)| (k.as_str().to_owned(), value_to_json(x, level + 1, cut)))
                .collect(),
        ),
        AMQPValue::ByteArray(b) => Value::String(hex::encode(b.as_slice())),
        AMQPValue::Void => Value::Null,
    }
}

/// A delivery's headers made fit to publish again (for the parked copy): values nested too
/// deep, and the parser's marker (a short-string value, which is not valid on the wire),
/// become [`HEADER_TOO_DEEP`] as a long string. Bounded by [`MAX_HEADER_DEPTH`].
pub(super) fn republishable(table: &FieldTable) -> FieldTable {
    republishable_table(table, 1)
}

fn republishable_table(table: &FieldTable, level: usize) -> FieldTable {
    let mut out = FieldTable::default();
    for (k, v) in table.inner() {
        out.insert(k.clone(), republishable_value(v, level + 1));
    }
    out
}

fn republishable_value(v: &AMQPValue, level: usize) -> AMQPValue {
    if too_deep(v, level) {
        return long_string(HEADER_TOO_DEEP);
    }
    match v {
        AMQPValue::FieldArray(a) => AMQPValue::FieldArray(FieldArray::from(
            a.as_slice()
                .iter()
                .map(|x| republishable_value(x, level + 1))
                .collect::<Vec<_>>(),
        )),
        AMQPValue::FieldTable(t) => AMQPValue::FieldTable(republishable_table(t, level)),
        // Has no AMQP type of its own: lapin would encode it as an unknown type.
        AMQPValue::ShortString(s) => long_string(s.as_str()),
        other => other.clone(),
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
            (map, None)
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
        let (j, _) = table_to_json(&t);
        assert_eq!(j["bytes"], "dead");
        assert_eq!(j["dec"], 1.5);
        assert_eq!(j["bad"], "\u{fffd}a");
    }

    #[cfg(feature = "fuzzing")]
    #[test]
    fn encoded_headers_convert_as_the_parsed_table_does() {
        let table = nested_tables(3, AMQPValue::Timestamp(7));
        let encoded = lapin::types::generation::gen_field_table(&table)(Vec::new().into())
            .expect("encodes")
            .write;
        assert_eq!(
            convert_encoded_headers(&encoded),
            Some(table_to_json(&table))
        );
        // Deeper than the bound on the wire: flagged, as a delivery's headers are.
        let (json, too_deep) =
            convert_encoded_headers(&wire_nested_arrays(MAX_HEADER_DEPTH + 5)).expect("parses");
        assert!(too_deep.is_some());
        assert_eq!(json_depth(&json).1, Value::String(HEADER_TOO_DEEP.into()));
        // Not exactly one table: refused, not guessed at.
        assert_eq!(convert_encoded_headers(&encoded[..encoded.len() - 1]), None);
        assert_eq!(
            convert_encoded_headers(&[&encoded[..], &[0]].concat()),
            None
        );
    }

    /// A headers table whose header `deep` nests tables `levels` deep, the headers table
    /// included; the innermost holds `end`.
    fn nested_tables(levels: usize, end: AMQPValue) -> FieldTable {
        let mut value = end;
        for _ in 1..levels {
            let mut t = FieldTable::default();
            t.insert("k".into(), value);
            value = AMQPValue::FieldTable(t);
        }
        let mut headers = FieldTable::default();
        headers.insert("deep".into(), value);
        headers.insert("x-aggregate-id".into(), long_string("o-1"));
        headers
    }

    /// Header `deep` as it arrives on the wire: `arrays` field arrays nested in one another.
    fn wire_nested_arrays(arrays: usize) -> Vec<u8> {
        let mut value = vec![b'V'];
        for _ in 0..arrays {
            let mut outer = vec![b'A'];
            outer.extend_from_slice(&u32::try_from(value.len()).expect("fits").to_be_bytes());
            outer.extend_from_slice(&value);
            value = outer;
        }
        let entry = [&[4u8][..], b"deep", &value].concat();
        [
            &u32::try_from(entry.len()).expect("fits").to_be_bytes()[..],
            &entry,
        ]
        .concat()
    }

    /// Levels of objects and arrays down the first entries of `deep` (the headers included),
    /// and the value found at the bottom.
    fn json_depth(headers: &Map<String, Value>) -> (usize, Value) {
        let mut levels = 1;
        let mut v = &headers["deep"];
        loop {
            let next = match v {
                Value::Array(a) => a.first(),
                Value::Object(o) => o.values().next(),
                _ => None,
            };
            match next {
                Some(n) => {
                    levels += 1;
                    v = n;
                }
                None => {
                    return (
                        levels + usize::from(v.is_array() || v.is_object()),
                        v.clone(),
                    );
                }
            }
        }
    }

    #[test]
    fn header_nesting_at_the_limit_is_converted_in_full() {
        let (json, too_deep) = table_to_json(&nested_tables(MAX_HEADER_DEPTH, AMQPValue::Void));
        assert_eq!(too_deep, None);
        assert_eq!(json_depth(&json), (MAX_HEADER_DEPTH, Value::Null));
    }

    #[test]
    fn header_nested_past_the_limit_becomes_the_marker() {
        let table = nested_tables(MAX_HEADER_DEPTH + 1, AMQPValue::Void);
        let (json, too_deep) = table_to_json(&table);
        let detail = too_deep.expect("flagged as too deep");
        assert!(
            detail.contains("\"deep\"") && detail.contains("64"),
            "{detail}"
        );
        assert_eq!(
            json_depth(&json),
            (MAX_HEADER_DEPTH, Value::String(HEADER_TOO_DEEP.into()))
        );
        assert_eq!(json["x-aggregate-id"], "o-1");
        assert!(HEADER_TOO_DEEP.contains(&MAX_HEADER_DEPTH.to_string()));
    }

    #[test]
    fn wire_headers_nested_as_deep_as_a_frame_allows_become_the_marker() {
        // 131,072 bytes hold about 26,200 nested arrays; unbounded, their parse alone needs
        // far more stack than a thread has.
        let bytes = wire_nested_arrays(26_200);
        let (rest, table) =
            lapin::types::parsing::parse_field_table(&bytes[..]).expect("parses, bounded");
        assert!(rest.is_empty());
        let (json, too_deep) = table_to_json(&table);
        assert!(too_deep.is_some());
        assert_eq!(
            json_depth(&json),
            (MAX_HEADER_DEPTH, Value::String(HEADER_TOO_DEEP.into()))
        );

        // The parked copy's headers: the marker as a long string, nothing deeper, no short
        // string value (which has no wire type).
        let parked = republishable(&table);
        let mut levels = 1;
        let mut v = parked.inner().get("deep").expect("kept");
        while let AMQPValue::FieldArray(a) = v {
            levels += 1;
            v = a.as_slice().first().expect("one element");
        }
        assert_eq!(levels, MAX_HEADER_DEPTH);
        assert_eq!(v, &long_string(HEADER_TOO_DEEP));
    }

    #[test]
    fn republished_headers_carry_no_short_string_values() {
        let mut table = nested_tables(3, AMQPValue::ShortString("inner".into()));
        table.insert("s".into(), AMQPValue::ShortString("top".into()));
        let parked = republishable(&table);
        assert_eq!(parked.inner()["s"], long_string("top"));
        assert_eq!(table_to_json(&parked), table_to_json(&table));
    }
}
