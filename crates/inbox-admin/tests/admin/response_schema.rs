//! Responses against the OpenAPI document the server serves: every documented 2xx response has
//! a typed schema, and a served body is valid against its route's schema and carries no field
//! the schema does not declare (the console reads fields by name: each must be stated).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

/// Every documented 2xx response without a typed schema: one line each, naming the route, the
/// media type and where in its schema (following `$ref`s) a value is left untyped. A map
/// (`additionalProperties`) is typed as one; its values may be anything.
pub(crate) fn untyped_responses(doc: &Value) -> Vec<String> {
    let mut found = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("a path item") {
            let Some(responses) = operation["responses"].as_object() else {
                continue;
            };
            for (status, response) in responses {
                if !status.starts_with('2') {
                    continue;
                }
                let route = format!("{} {path} {status}", method.to_uppercase());
                let Some(content) = response["content"].as_object().filter(|c| !c.is_empty())
                else {
                    found.push(format!("{route}: no content"));
                    continue;
                };
                for (media, body) in content {
                    let at = format!("{route} {media}");
                    match body.get("schema") {
                        None => found.push(format!("{at}: no schema")),
                        Some(schema) => {
                            untyped(doc, schema, &at, &mut BTreeSet::new(), &mut found);
                        }
                    }
                }
            }
        }
    }
    found
}

/// Adds to `found` where `schema` (at `at`) leaves a value untyped: `{}`, an object without
/// declared properties, an array without items. `seen`: the `$ref`s already followed.
fn untyped(
    doc: &Value,
    schema: &Value,
    at: &str,
    seen: &mut BTreeSet<String>,
    found: &mut Vec<String>,
) {
    if let Some(reference) = schema["$ref"].as_str() {
        if seen.insert(reference.to_owned()) {
            let target = resolve(doc, reference);
            untyped(doc, target, &format!("{at} -> {reference}"), seen, found);
        }
        return;
    }
    let mut declared = false;
    for key in ["allOf", "oneOf", "anyOf"] {
        if let Some(parts) = schema[key].as_array() {
            declared = true;
            for (i, part) in parts.iter().enumerate() {
                untyped(doc, part, &format!("{at}/{key}/{i}"), seen, found);
            }
        }
    }
    if let Some(properties) = schema["properties"].as_object() {
        declared = true;
        for (name, property) in properties {
            untyped(doc, property, &format!("{at}.{name}"), seen, found);
        }
    }
    if schema
        .get("additionalProperties")
        .is_some_and(|a| *a != Value::Bool(false))
    {
        declared = true;
    }
    match schema.get("items") {
        Some(items) => untyped(doc, items, &format!("{at}[]"), seen, found),
        None if types_of(schema).contains("array") => {
            found.push(format!("{at}: an array of undeclared items"));
        }
        None => {}
    }
    let types = types_of(schema);
    if types.contains("object") && !declared {
        found.push(format!(
            "{at}: an object without declared properties: {schema}"
        ));
    }
    if types.is_empty()
        && !declared
        && schema.get("enum").is_none()
        && schema.get("const").is_none()
    {
        found.push(format!("{at}: no type: {schema}"));
    }
}

/// The `type` of `schema`: one name or a list of them.
fn types_of(schema: &Value) -> BTreeSet<&str> {
    match &schema["type"] {
        Value::String(one) => BTreeSet::from([one.as_str()]),
        Value::Array(many) => many.iter().filter_map(Value::as_str).collect(),
        _ => BTreeSet::new(),
    }
}

/// The schema a local `$ref` (`#/components/schemas/...`) points to.
fn resolve<'a>(doc: &'a Value, reference: &str) -> &'a Value {
    let pointer = reference
        .strip_prefix('#')
        .unwrap_or_else(|| panic!("a local reference: {reference}"));
    doc.pointer(pointer)
        .unwrap_or_else(|| panic!("{reference} is not in the document"))
}

/// `schema` with its `$ref`s followed.
fn followed<'a>(doc: &'a Value, mut schema: &'a Value) -> &'a Value {
    while let Some(reference) = schema["$ref"].as_str() {
        schema = resolve(doc, reference);
    }
    schema
}

/// The JSON schema of the `status` response of `method path` (`path` as documented, such as
/// `/api/v1/messages/{consumer}/{message_id}`).
pub(crate) fn response_schema<'a>(
    doc: &'a Value,
    method: &str,
    path: &str,
    status: u16,
) -> &'a Value {
    let response = &doc["paths"][path][method.to_lowercase()]["responses"][status.to_string()];
    let schema = &response["content"]["application/json"]["schema"];
    assert!(
        schema.is_object(),
        "{method} {path} documents no JSON schema for {status}: {response}"
    );
    schema
}

/// What is wrong with `body`, the `status` response of `method path`, against the document
/// `doc`: where it is invalid against the route's schema (the document's components embedded,
/// so its `$ref`s resolve), and each field it has that the schema does not declare.
pub(crate) fn response_faults(
    doc: &Value,
    method: &str,
    path: &str,
    status: u16,
    body: &Value,
) -> Vec<String> {
    let schema = response_schema(doc, method, path, status);
    let mut root = schema.clone();
    root.as_object_mut()
        .expect("a schema object")
        .insert("components".into(), doc["components"].clone());
    let validator = jsonschema::validator_for(&root)
        .unwrap_or_else(|e| panic!("{method} {path}: the schema does not compile: {e}"));
    let mut faults: Vec<String> = validator
        .iter_errors(body)
        .map(|e| format!("invalid at {}: {e}", e.instance_path()))
        .collect();
    undeclared(doc, body, schema, "$", &mut faults);
    faults
}

/// Adds to `faults` each field of `value` (at `at`) that `schema` does not declare, and each
/// array whose items it does not describe. A `oneOf`/`anyOf` declares a field when one of its
/// branches declares all of the value's; an `allOf` declares what any of its parts does.
fn undeclared(doc: &Value, value: &Value, schema: &Value, at: &str, faults: &mut Vec<String>) {
    let schema = followed(doc, schema);
    for key in ["oneOf", "anyOf"] {
        if let Some(branches) = schema[key].as_array() {
            let mut fewest: Option<Vec<String>> = None;
            for branch in branches {
                let mut found = Vec::new();
                undeclared(doc, value, branch, at, &mut found);
                if fewest.as_ref().is_none_or(|f| found.len() < f.len()) {
                    fewest = Some(found);
                }
            }
            faults.extend(fewest.unwrap_or_default());
            return;
        }
    }
    match value {
        Value::Object(fields) => {
            let mut properties = BTreeMap::new();
            let mut map_values = Vec::new();
            declared_fields(doc, schema, &mut properties, &mut map_values);
            for (name, field) in fields {
                let here = format!("{at}.{name}");
                if let Some(schemas) = properties.get(name.as_str()) {
                    for s in schemas {
                        undeclared(doc, field, s, &here, faults);
                    }
                } else if !map_values.is_empty() {
                    for s in map_values.iter().filter(|s| !is_any_value(s)) {
                        undeclared(doc, field, s, &here, faults);
                    }
                } else {
                    faults.push(format!("{here}: a field the schema does not declare"));
                }
            }
        }
        Value::Array(items) if !items.is_empty() => match item_schema(doc, schema) {
            Some(item) => {
                for (i, v) in items.iter().enumerate() {
                    undeclared(doc, v, item, &format!("{at}[{i}]"), faults);
                }
            }
            None => faults.push(format!(
                "{at}: an array whose items the schema does not describe"
            )),
        },
        _ => {}
    }
}

/// The properties `schema` declares (its `allOf` parts' too), and the schemas of a map's
/// values (`additionalProperties`).
fn declared_fields<'a>(
    doc: &'a Value,
    schema: &'a Value,
    properties: &mut BTreeMap<&'a str, Vec<&'a Value>>,
    map_values: &mut Vec<&'a Value>,
) {
    static ANY: Value = Value::Bool(true);
    let schema = followed(doc, schema);
    if let Some(declared) = schema["properties"].as_object() {
        for (name, s) in declared {
            properties.entry(name.as_str()).or_default().push(s);
        }
    }
    match schema.get("additionalProperties") {
        Some(Value::Bool(true)) => map_values.push(&ANY),
        Some(values @ Value::Object(_)) => map_values.push(values),
        _ => {}
    }
    for part in schema["allOf"].as_array().into_iter().flatten() {
        declared_fields(doc, part, properties, map_values);
    }
}

/// The schema of `schema`'s array items (its `allOf` parts' too).
fn item_schema<'a>(doc: &'a Value, schema: &'a Value) -> Option<&'a Value> {
    let schema = followed(doc, schema);
    schema.get("items").or_else(|| {
        schema["allOf"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|part| item_schema(doc, part))
    })
}

/// `true` or `{}`: a map whose values may be anything, declared so.
fn is_any_value(schema: &Value) -> bool {
    *schema == Value::Bool(true) || schema.as_object().is_some_and(|o| o.is_empty())
}
