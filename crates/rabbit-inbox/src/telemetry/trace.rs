//! One span per delivery, `inbox.delivery`, from receipt to settlement. With the `otel`
//! feature it is a child of the producer's W3C trace context (`traceparent`, `tracestate`),
//! so an OpenTelemetry layer exports it into the producer's trace.
//!
//! Spans and logs carry identifiers and codes, never bodies or header values beyond the
//! trace context: a payload may hold personal data.

use tracing::Span;

use crate::{envelope::Envelope, status::Outcome, telemetry::metrics::outcome_label};

/// The span of one delivery. Fields: `message_id` (the inbox key), `consumer`,
/// `message_type`, `correlation_id`, `redelivered`, and `outcome` (recorded at settlement,
/// one of [`crate::telemetry::metrics::OUTCOME_LABELS`]).
pub(crate) fn delivery_span(consumer: &str, envelope: &Envelope) -> Span {
    let span = tracing::info_span!(
        target: "rabbit_inbox::delivery",
        "inbox.delivery",
        otel.kind = "consumer",
        messaging.system = "rabbitmq",
        message_id = %envelope.message_id,
        consumer,
        message_type = %envelope.message_type,
        correlation_id = envelope.correlation_id.as_deref(),
        redelivered = envelope.redelivered,
        outcome = tracing::field::Empty,
    );
    #[cfg(feature = "otel")]
    if !span.is_disabled() {
        continue_producer_trace(&span, envelope);
    }
    span
}

/// Records the outcome on the delivery's span.
pub(crate) fn record_outcome(span: &Span, outcome: &Outcome) {
    span.record("outcome", outcome_label(outcome));
}

/// Makes the span a child of the producer's trace context, when the message carries one.
#[cfg(feature = "otel")]
fn continue_producer_trace(span: &Span, envelope: &Envelope) {
    use std::collections::HashMap;

    use opentelemetry::propagation::TextMapPropagator;
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    let Some(traceparent) = &envelope.traceparent else {
        return;
    };
    let mut carrier = HashMap::with_capacity(2);
    carrier.insert("traceparent".to_owned(), traceparent.clone());
    if let Some(serde_json::Value::String(state)) = envelope.headers.get("tracestate") {
        carrier.insert("tracestate".to_owned(), state.clone());
    }
    let parent = TraceContextPropagator::new().extract(&carrier);
    // Fails only when no OpenTelemetry layer is installed; the span is then a plain one.
    let _ = span.set_parent(parent);
}

/// The W3C trace context (`traceparent`, `tracestate`) of the current span, if it belongs to
/// a valid OpenTelemetry trace: what a message written now (an outbox enqueue from a web
/// request's span) carries on, so its consumer's span joins the same trace.
#[cfg(feature = "otel")]
pub(crate) fn current_trace_context() -> Option<(String, Option<String>)> {
    use std::collections::HashMap;

    use opentelemetry::{propagation::TextMapPropagator, trace::TraceContextExt};
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    let cx = Span::current().context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier: HashMap<String, String> = HashMap::with_capacity(2);
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    let traceparent = carrier.remove("traceparent")?;
    Some((
        traceparent,
        carrier.remove("tracestate").filter(|s| !s.is_empty()),
    ))
}
