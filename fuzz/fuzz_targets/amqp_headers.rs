//! Arbitrary AMQP header tables, encoded as on the wire, through the header conversion (the
//! bounded parser, then JSON), then through `parse`.

#![no_main]

use arbitrary::Arbitrary;
use lapin::types::{
    AMQPValue, DecimalValue, FieldArray, FieldTable, LongString, ShortString,
    generation::gen_field_table,
};
use libfuzzer_sys::fuzz_target;
use rabbit_inbox::{
    AmqpMessage, HEADER_TOO_DEEP, MAX_HEADER_DEPTH, broker::convert_encoded_headers,
};
use rabbit_inbox_fuzz::{Body, Name, check, rule_sets};
use serde_json::Value;

/// Every AMQP field value kind, nested.
#[derive(Debug, Arbitrary)]
enum Field {
    Boolean(bool),
    ShortShortInt(i8),
    ShortShortUInt(u8),
    ShortInt(i16),
    ShortUInt(u16),
    LongInt(i32),
    LongUInt(u32),
    LongLongInt(i64),
    Float(f32),
    Double(f64),
    Decimal(u8, u32),
    ShortString(Name),
    /// Raw bytes: often not UTF-8.
    LongString(Vec<u8>),
    Array(Vec<Field>),
    Timestamp(u64),
    Table(Vec<(Name, Field)>),
    ByteArray(Vec<u8>),
    Void,
}

fn short(name: &Name) -> ShortString {
    // A short string holds at most 255 bytes on the wire.
    let mut s = name.0.clone();
    while s.len() > 255 {
        s.pop();
    }
    ShortString::from(s)
}

fn to_amqp(f: &Field) -> AMQPValue {
    match f {
        Field::Boolean(b) => AMQPValue::Boolean(*b),
        Field::ShortShortInt(n) => AMQPValue::ShortShortInt(*n),
        Field::ShortShortUInt(n) => AMQPValue::ShortShortUInt(*n),
        Field::ShortInt(n) => AMQPValue::ShortInt(*n),
        Field::ShortUInt(n) => AMQPValue::ShortUInt(*n),
        Field::LongInt(n) => AMQPValue::LongInt(*n),
        Field::LongUInt(n) => AMQPValue::LongUInt(*n),
        Field::LongLongInt(n) => AMQPValue::LongLongInt(*n),
        Field::Float(x) => AMQPValue::Float(*x),
        Field::Double(x) => AMQPValue::Double(*x),
        Field::Decimal(scale, value) => AMQPValue::DecimalValue(DecimalValue {
            scale: *scale,
            value: *value,
        }),
        Field::ShortString(s) => AMQPValue::ShortString(short(s)),
        Field::LongString(b) => AMQPValue::LongString(LongString::from(b.clone())),
        Field::Array(a) => {
            AMQPValue::FieldArray(FieldArray::from(a.iter().map(to_amqp).collect::<Vec<_>>()))
        }
        Field::Timestamp(t) => AMQPValue::Timestamp(*t),
        Field::Table(t) => AMQPValue::FieldTable(to_table(t)),
        Field::ByteArray(b) => AMQPValue::ByteArray(b.clone().into()),
        Field::Void => AMQPValue::Void,
    }
}

fn to_table(entries: &[(Name, Field)]) -> FieldTable {
    let mut table = FieldTable::default();
    for (k, v) in entries {
        table.insert(short(k), to_amqp(v));
    }
    table
}

/// What each AMQP value must become in JSON; `level` is the nesting level it has if it is a
/// table or array (the headers table is 1). Returns whether a value was too deep to convert.
fn check_value(amqp: &AMQPValue, json: &Value, level: usize) -> bool {
    if matches!(amqp, AMQPValue::FieldArray(_) | AMQPValue::FieldTable(_))
        && level > MAX_HEADER_DEPTH
    {
        assert_eq!(
            json.as_str(),
            Some(HEADER_TOO_DEEP),
            "the marker past the bound"
        );
        return true;
    }
    let mut cut = false;
    match amqp {
        AMQPValue::Boolean(b) => assert_eq!(json, &Value::Bool(*b)),
        AMQPValue::ShortShortInt(n) => assert_eq!(json.as_i64(), Some(i64::from(*n))),
        AMQPValue::ShortShortUInt(n) => assert_eq!(json.as_u64(), Some(u64::from(*n))),
        AMQPValue::ShortInt(n) => assert_eq!(json.as_i64(), Some(i64::from(*n))),
        AMQPValue::ShortUInt(n) => assert_eq!(json.as_u64(), Some(u64::from(*n))),
        AMQPValue::LongInt(n) => assert_eq!(json.as_i64(), Some(i64::from(*n))),
        AMQPValue::LongUInt(n) => assert_eq!(json.as_u64(), Some(u64::from(*n))),
        AMQPValue::LongLongInt(n) => assert_eq!(json.as_i64(), Some(*n)),
        AMQPValue::Timestamp(t) => assert_eq!(json.as_u64(), Some(*t)),
        AMQPValue::Float(x) if x.is_finite() => assert_eq!(json.as_f64(), Some(f64::from(*x))),
        AMQPValue::Double(x) if x.is_finite() => assert_eq!(json.as_f64(), Some(*x)),
        // JSON has no NaN or infinity.
        AMQPValue::Float(_) | AMQPValue::Double(_) => assert!(json.is_null()),
        AMQPValue::DecimalValue(_) => assert!(json.is_number() || json.is_null()),
        AMQPValue::ShortString(s) => assert_eq!(json.as_str(), Some(s.as_str())),
        AMQPValue::LongString(s) => match std::str::from_utf8(s.as_bytes()) {
            Ok(text) => assert_eq!(json.as_str(), Some(text)),
            Err(_) => assert!(json.is_string()),
        },
        AMQPValue::ByteArray(b) => {
            assert_eq!(json.as_str(), Some(hex::encode(b.as_slice()).as_str()));
        }
        AMQPValue::FieldArray(a) => {
            let items = json.as_array().expect("an array stays an array");
            assert_eq!(items.len(), a.as_slice().len());
            for (x, j) in a.as_slice().iter().zip(items) {
                cut |= check_value(x, j, level + 1);
            }
        }
        AMQPValue::FieldTable(t) => {
            let map = json.as_object().expect("a table stays an object");
            cut |= check_table(t, map, level);
        }
        AMQPValue::Void => assert!(json.is_null()),
    }
    cut
}

/// `table`, at nesting level `level`, against its JSON; whether a value was too deep.
fn check_table(table: &FieldTable, map: &serde_json::Map<String, Value>, level: usize) -> bool {
    assert_eq!(map.len(), table.inner().len(), "no header lost or added");
    let mut cut = false;
    for (k, v) in table.inner() {
        cut |= check_value(v, &map[k.as_str()], level + 1);
    }
    cut
}

#[derive(Debug, Arbitrary)]
struct Input {
    message_id: Option<String>,
    headers: Vec<(Name, Field)>,
    body: Body,
    header: String,
}

fuzz_target!(|input: Input| {
    let table = to_table(&input.headers);
    let encoded = gen_field_table(&table)(Vec::new().into())
        .expect("a table encodes")
        .write;
    let (headers, headers_truncated) =
        convert_encoded_headers(&encoded).expect("an encoded table parses");
    let cut = check_table(&table, &headers, 1);
    assert_eq!(cut, headers_truncated.is_some(), "flagged exactly when cut");
    assert_eq!(
        (headers.clone(), headers_truncated.clone()),
        convert_encoded_headers(&encoded).expect("an encoded table parses"),
        "the conversion is deterministic"
    );
    let msg = AmqpMessage {
        message_id: input.message_id,
        kind: None,
        content_type: Some("application/json".into()),
        correlation_id: None,
        headers,
        headers_truncated,
        body: input.body.to_bytes(),
        redelivered: false,
    };
    for rules in rule_sets(&input.header, &["/id".to_owned()]) {
        check(&msg, &rules);
    }
});
