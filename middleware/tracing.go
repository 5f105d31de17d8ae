package middleware

import (
	"context"
	"errors"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/txoutbox/txoutbox"
)

// ScopeName is the instrumentation scope of the tracer Tracing uses when given
// none.
const ScopeName = "github.com/txoutbox/txoutbox/middleware"

// Span attributes set by Tracing besides the messaging semantic conventions.
const (
	AttributeOutboxID = attribute.Key("txoutbox.outbox.id")
	AttributeAttempt  = attribute.Key("txoutbox.attempt")
	AttributeKey      = attribute.Key("txoutbox.key")
	AttributeWorkerID = attribute.Key("txoutbox.worker.id")
)

// MetadataCarrier adapts Watermill message metadata to an OpenTelemetry
// propagation.TextMapCarrier. A consumer extracts the context Tracing stored
// with propagator.Extract(ctx, middleware.MetadataCarrier(msg.Metadata)).
type MetadataCarrier message.Metadata

var _ propagation.TextMapCarrier = MetadataCarrier(nil)

// Get returns the value of key, "" when absent.
func (c MetadataCarrier) Get(key string) string { return c[key] }

// Set stores value under key.
func (c MetadataCarrier) Set(key, value string) { c[key] = value }

// Keys lists the keys in the carrier.
func (c MetadataCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

func orTraceContext(p propagation.TextMapPropagator) propagation.TextMapPropagator {
	if p == nil {
		return propagation.TraceContext{}
	}
	return p
}

// TracePublisherDecorator returns a function for
// txoutbox.PublisherConfig.Decorate that stores the trace context of
// msg.Context() in the message metadata, so it is written with the record.
// Set the producer's context on the message first (msg.SetContext(ctx);
// Watermill's CQRS buses do it). A nil propagator means W3C Trace Context
// (the traceparent and tracestate keys). A message whose context holds no
// span is stored unchanged.
func TracePublisherDecorator(propagator propagation.TextMapPropagator) func(msg *message.Message) error {
	propagator = orTraceContext(propagator)
	return func(msg *message.Message) error {
		if msg.Metadata == nil {
			msg.Metadata = make(message.Metadata)
		}
		propagator.Inject(msg.Context(), MetadataCarrier(msg.Metadata))
		return nil
	}
}

// Tracing returns forwarder middleware that wraps each publish in a span
// "txoutbox publish <topic>" of kind producer. The span is linked to the trace
// context the producer stored in the metadata (see TracePublisherDecorator),
// and its own context replaces that one in the metadata, so the consumer
// continues the relay's trace. While the rest of the chain runs, the message
// context (the forwarder's, with its Delivery) also holds the span. A failed
// publish records the error on the span and puts the message's context and
// trace metadata back, so that a Watermill Retry placed before this middleware
// starts its next span linked to the producer again. A nil tracer means the global
// provider's tracer for ScopeName; a nil propagator means W3C Trace Context.
func Tracing(tracer trace.Tracer, propagator propagation.TextMapPropagator) message.HandlerMiddleware {
	if tracer == nil {
		tracer = otel.GetTracerProvider().Tracer(ScopeName)
	}
	propagator = orTraceContext(propagator)
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			parent := msg.Context()
			topic := topicOf(msg)

			opts := []trace.SpanStartOption{
				trace.WithSpanKind(trace.SpanKindProducer),
				trace.WithAttributes(spanAttributes(msg, topic)...),
			}
			producer := trace.SpanContextFromContext(propagator.Extract(parent, MetadataCarrier(msg.Metadata)))
			if producer.IsValid() {
				opts = append(opts, trace.WithLinks(trace.Link{SpanContext: producer}))
			}
			ctx, span := tracer.Start(parent, "txoutbox publish "+topic, opts...)
			defer span.End()

			if msg.Metadata == nil {
				msg.Metadata = make(message.Metadata)
			}
			undo := restore(msg, parent, propagator.Fields())
			propagator.Inject(ctx, MetadataCarrier(msg.Metadata))
			msg.SetContext(ctx)

			out, err := h(msg)
			if err != nil {
				// A retry around this middleware must see the producer's
				// context again, not this span's. Only after a failure: a
				// target that succeeded may still hold the message.
				undo()
				span.RecordError(err)
				span.SetStatus(codes.Error, err.Error())
				span.SetAttributes(semconv.ErrorTypeKey.String(errorType(err)))
			}
			return out, err
		}
	}
}

// restore returns a function that puts back msg's context and the metadata
// under fields as they are now.
func restore(msg *message.Message, ctx context.Context, fields []string) func() {
	saved := make(map[string]string, len(fields))
	for _, f := range fields {
		if v, ok := msg.Metadata[f]; ok {
			saved[f] = v
		}
	}
	return func() {
		msg.SetContext(ctx)
		for _, f := range fields {
			if v, ok := saved[f]; ok {
				msg.Metadata[f] = v
			} else {
				delete(msg.Metadata, f)
			}
		}
	}
}

// errorType is the low-cardinality error.type of a failed publish.
func errorType(err error) string {
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return "timeout"
	case errors.Is(err, context.Canceled):
		return "canceled"
	default:
		return "publish_failed"
	}
}

func spanAttributes(msg *message.Message, topic string) []attribute.KeyValue {
	attrs := []attribute.KeyValue{
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName("publish"),
		semconv.MessagingDestinationName(topic),
		semconv.MessagingMessageID(msg.UUID),
		semconv.MessagingMessageBodySize(len(msg.Payload)),
		AttributeAttempt.Int(AttemptFromMessage(msg)),
	}
	if id, ok := OutboxIDFromMessage(msg); ok {
		attrs = append(attrs, AttributeOutboxID.Int64(id))
	}
	if key := msg.Metadata.Get(txoutbox.MetadataKey); key != "" {
		attrs = append(attrs, AttributeKey.String(key))
	}
	if d, ok := txoutbox.DeliveryFromContext(msg.Context()); ok && d.WorkerID != "" {
		attrs = append(attrs, AttributeWorkerID.String(d.WorkerID))
	}
	return attrs
}
