package txoutbox

import (
	"context"
	"errors"
	"net"
	"strings"
	"syscall"
)

// Error classes a target or a middleware can put on a publish error. The
// forwarder tests them with errors.Is.
var (
	// ErrPermanent marks a publish error that retrying cannot fix (the
	// message is too large, a schema registry rejects it): the record is
	// dead-lettered at once, whatever its attempts. Wrap with Permanent.
	ErrPermanent = errors.New("permanent publish error")
	// ErrUnavailable marks a publish error that says the broker (or the
	// topic) cannot be reached, not that the message is bad: the record is
	// given back untried (no attempt charged) and the failure counts toward
	// an outage of its topic. Wrap with Unavailable.
	ErrUnavailable = errors.New("target unavailable")
)

// classError is an error with a class sentinel: errors.Is finds both.
type classError struct {
	err   error
	class error
}

func (e *classError) Error() string   { return e.class.Error() + ": " + e.err.Error() }
func (e *classError) Unwrap() []error { return []error{e.err, e.class} }

// Permanent marks err permanent (see ErrPermanent): the forwarder
// dead-letters the record at once. errors.Is(Permanent(err), err) holds.
// Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &classError{err: err, class: ErrPermanent}
}

// Unavailable marks err as the target being unavailable (see
// ErrUnavailable): the record is not charged an attempt and the failure
// counts toward an outage. errors.Is(Unavailable(err), err) holds.
// Unavailable(nil) is nil.
func Unavailable(err error) error {
	if err == nil {
		return nil
	}
	return &classError{err: err, class: ErrUnavailable}
}

// errorClass is what the forwarder makes of a failed publish.
type errorClass uint8

const (
	classRecord      errorClass = iota // may be the record's fault: charged
	classPermanent                     // the record's fault for good: dead-letter
	classUnavailable                   // the target's fault: not charged
)

// unavailableTexts are error texts of Watermill's publishers (and the clients
// under them) that say the broker cannot be reached right now. They are
// matched as substrings, since the publishers wrap them in text of their own.
var unavailableTexts = []string{
	// Sarama (watermill-kafka).
	"kafka: client has run out of available brokers",
	"kafka: tried to use a client that was closed",
	"kafka: broker not connected",
	"kafka server: In the middle of a leadership election",
	"kafka server: Broker not available",
	// Sarama's per-partition breaker (eapache/go-resiliency), which opens
	// on a broker's errors and flaps while it comes back, and Watermill's
	// CircuitBreaker middleware (sony/gobreaker).
	"circuit breaker is open",
	// amqp091-go (watermill-amqp).
	"Exception (504) Reason: \"channel/connection is not open\"",
	"not connected to AMQP",
	// nats.go (watermill-nats).
	"nats: connection closed",
	"nats: no servers available for connection",
	"nats: no responders available for request",
	"nats: connection draining",
	"nats: connection reconnecting",
}

// classify tells what a publish error says: permanent (marked), unavailable
// (marked, a refused or reset connection, or a known text of Watermill's
// publishers), or possibly the record's fault. A deadline or publish
// timeout is the record's: a record that hangs its publish must still run
// out of attempts. Timeouts of every record count toward an outage anyway.
func classify(err error) errorClass {
	switch {
	case errors.Is(err, ErrPermanent):
		return classPermanent
	case errors.Is(err, ErrUnavailable),
		errors.Is(err, syscall.ECONNREFUSED),
		errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.EHOSTUNREACH),
		errors.Is(err, syscall.ENETUNREACH):
		return classUnavailable
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, ErrPublishTimeout):
		return classRecord
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		return classUnavailable
	}
	msg := err.Error()
	for _, s := range unavailableTexts {
		if strings.Contains(msg, s) {
			return classUnavailable
		}
	}
	return classRecord
}
