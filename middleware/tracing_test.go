package middleware_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/middleware"
)

func newTracer(t *testing.T) (trace.Tracer, *tracetest.InMemoryExporter) {
	t.Helper()
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tp.Tracer("txoutbox-test"), exp
}

// publishTraced writes one message to topic inside a producer span, through
// the transactional publisher with the tracing decorator, and returns the
// producer span's context and the message UUID.
func publishTraced(t *testing.T, o *outbox, tracer trace.Tracer, topic, key string) (trace.SpanContext, string) {
	t.Helper()
	ctx, span := tracer.Start(context.Background(), "place order")
	defer span.End()
	tx, err := o.db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	pub, err := txoutbox.NewTxPublisher(o.store, tx, txoutbox.PublisherConfig{Decorate: middleware.TracePublisherDecorator(nil)})
	if err != nil {
		t.Fatal(err)
	}
	msg := message.NewMessage(watermill.NewUUID(), []byte(`{"order":1}`))
	msg.Metadata.Set(txoutbox.MetadataKey, key)
	msg.SetContext(ctx)
	if err := pub.Publish(topic, msg); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return span.SpanContext(), msg.UUID
}

func publishSpans(exp *tracetest.InMemoryExporter, name string) tracetest.SpanStubs {
	var out tracetest.SpanStubs
	for _, s := range exp.GetSpans() {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

func attrs(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}

func TestTracingLinksTheProducerAndReachesTheConsumer(t *testing.T) {
	t.Parallel()
	tracer, exp := newTracer(t)
	o := newOutbox(t)
	producer, uuid := publishTraced(t, o, tracer, "orders", "order-1")

	p := newTarget(nil)
	f := newForwarder(t, o, p, fastConfig(0, middleware.Tracing(tracer, nil)))
	if res, err := f.RunOnce(context.Background()); err != nil || res.Published != 1 {
		t.Fatalf("RunOnce = %+v, %v; want 1 published", res, err)
	}

	spans := publishSpans(exp, "txoutbox publish orders")
	if len(spans) != 1 {
		t.Fatalf("got %d publish spans, want 1 (all spans: %v)", len(spans), exp.GetSpans().Snapshots())
	}
	span := spans[0]
	if span.SpanKind != trace.SpanKindProducer {
		t.Errorf("span kind = %v, want producer", span.SpanKind)
	}
	if len(span.Links) != 1 || span.Links[0].SpanContext.TraceID() != producer.TraceID() || span.Links[0].SpanContext.SpanID() != producer.SpanID() {
		t.Fatalf("span links = %+v, want one link to the producer span %s/%s", span.Links, producer.TraceID(), producer.SpanID())
	}
	if span.Status.Code == codes.Error {
		t.Errorf("span status = %+v, want no error", span.Status)
	}
	a := attrs(span)
	for key, want := range map[attribute.Key]any{
		"messaging.message.id":       uuid,
		"messaging.destination.name": "orders",
		"messaging.operation.type":   "send",
		middleware.AttributeAttempt:  int64(1),
		middleware.AttributeKey:      "order-1",
		middleware.AttributeOutboxID: int64(1),
	} {
		if got := a[key].AsInterface(); got != want {
			t.Errorf("attribute %s = %v (%T), want %v", key, got, got, want)
		}
	}

	// The consumer continues the publish span's trace.
	got := p.received()
	if len(got) != 1 || got[0].Metadata.Get("traceparent") == "" {
		t.Fatalf("target got %+v, want one message with a traceparent", got)
	}
	sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), middleware.MetadataCarrier(got[0].Metadata)))
	if sc.TraceID() != span.SpanContext.TraceID() || sc.SpanID() != span.SpanContext.SpanID() {
		t.Errorf("consumer's traceparent %q is not the publish span %s/%s", got[0].Metadata.Get("traceparent"), span.SpanContext.TraceID(), span.SpanContext.SpanID())
	}
}

func TestTracePublisherDecoratorStoresTheProducerContext(t *testing.T) {
	t.Parallel()
	tracer, _ := newTracer(t)
	decorate := middleware.TracePublisherDecorator(propagation.TraceContext{})

	ctx, span := tracer.Start(context.Background(), "producer")
	defer span.End()
	msg := message.NewMessage(watermill.NewUUID(), nil)
	msg.SetContext(ctx)
	if err := decorate(msg); err != nil {
		t.Fatal(err)
	}
	sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), middleware.MetadataCarrier(msg.Metadata)))
	if sc.TraceID() != span.SpanContext().TraceID() || sc.SpanID() != span.SpanContext().SpanID() {
		t.Errorf("stored traceparent %q, want the producer span %s", msg.Metadata.Get("traceparent"), span.SpanContext().SpanID())
	}

	// Without a span, nothing is stored.
	plain := message.NewMessage(watermill.NewUUID(), nil)
	plain.Metadata = nil
	if err := decorate(plain); err != nil {
		t.Fatal(err)
	}
	if len(plain.Metadata) != 0 {
		t.Errorf("metadata of a message without a span = %v, want empty", plain.Metadata)
	}
}

// A failed publish is an error on its span; each try, even one repeated by
// Watermill's Retry around the tracing middleware, links to the producer and
// not to the previous try.
func TestTracingRecordsFailuresAndRetries(t *testing.T) {
	t.Parallel()
	tracer, exp := newTracer(t)
	o := newOutbox(t)
	producer, _ := publishTraced(t, o, tracer, "orders", "")

	p := newTarget(func(_ *message.Message, try int) error {
		if try == 1 {
			return errBroker
		}
		return nil
	})
	retry := wmw.Retry{MaxRetries: 1, InitialInterval: time.Millisecond}
	f := newForwarder(t, o, p, fastConfig(0, retry.Middleware, middleware.Tracing(tracer, nil)))
	if res, err := f.RunOnce(context.Background()); err != nil || res.Published != 1 {
		t.Fatalf("RunOnce = %+v, %v; want 1 published", res, err)
	}

	spans := publishSpans(exp, "txoutbox publish orders")
	if len(spans) != 2 {
		t.Fatalf("got %d publish spans, want 2", len(spans))
	}
	failed, ok := spans[0], spans[1]
	if failed.Status.Code != codes.Error || len(failed.Events) == 0 || failed.Events[0].Name != "exception" {
		t.Errorf("failed try: status %+v, events %+v; want an error status and an exception event", failed.Status, failed.Events)
	}
	if ok.Status.Code == codes.Error {
		t.Errorf("successful try has status %+v", ok.Status)
	}
	for i, s := range spans {
		if len(s.Links) != 1 || s.Links[0].SpanContext.SpanID() != producer.SpanID() {
			t.Errorf("span %d links = %+v, want the producer span %s", i, s.Links, producer.SpanID())
		}
		if s.Parent.IsValid() {
			t.Errorf("span %d has parent %s, want a root span", i, s.Parent.SpanID())
		}
	}
	got := p.received()
	if len(got) != 1 {
		t.Fatalf("target got %d messages, want 1", len(got))
	}
	sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), middleware.MetadataCarrier(got[0].Metadata)))
	if sc.SpanID() != ok.SpanContext.SpanID() {
		t.Errorf("consumer got span %s, want the successful try's %s", sc.SpanID(), ok.SpanContext.SpanID())
	}
}

// Metrics and tracing compose, and the Delivery survives the tracing
// middleware's context (the forwarder's innermost handler needs it).
func TestTracingAndMetricsTogether(t *testing.T) {
	t.Parallel()
	tracer, exp := newTracer(t)
	o := newOutbox(t)
	publishTraced(t, o, tracer, "orders", "k")
	m := newMetrics(t, prometheus.NewRegistry(), 0)

	var sawSpan bool
	probe := func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			_, hasDelivery := txoutbox.DeliveryFromContext(msg.Context())
			sawSpan = hasDelivery && trace.SpanContextFromContext(msg.Context()).IsValid()
			return h(msg)
		}
	}
	f := newForwarder(t, o, newTarget(nil), fastConfig(0, middleware.Tracing(tracer, nil), m.Middleware, probe))
	if res, err := f.RunOnce(context.Background()); err != nil || res.Published != 1 {
		t.Fatalf("RunOnce = %+v, %v; want 1 published", res, err)
	}
	if !sawSpan {
		t.Error("inner middleware did not see both the Delivery and the span in the message context")
	}
	if n := len(publishSpans(exp, "txoutbox publish orders")); n != 1 {
		t.Errorf("%d publish spans, want 1", n)
	}
}
