package txoutbox

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"syscall"
	"testing"
)

func TestClassify(t *testing.T) {
	base := errors.New("boom")
	dial := &net.OpError{Op: "dial", Net: "tcp", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}
	cases := []struct {
		name string
		err  error
		want errorClass
	}{
		{"plain", base, classRecord},
		{"permanent", Permanent(base), classPermanent},
		{"wrapped permanent", fmt.Errorf("publish: %w", Permanent(base)), classPermanent},
		{"unavailable", Unavailable(base), classUnavailable},
		{"connection refused", fmt.Errorf("publish: %w", dial), classUnavailable},
		{"dial error", &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("no route")}, classUnavailable},
		{"connection reset", fmt.Errorf("write: %w", syscall.ECONNRESET), classUnavailable},
		{"sarama out of brokers", errors.New("cannot produce message: kafka: client has run out of available brokers to talk to: dial tcp"), classUnavailable},
		{"sarama breaker open", errors.New("cannot produce message x: circuit breaker is open"), classUnavailable},
		{"amqp closed", errors.New(`Exception (504) Reason: "channel/connection is not open"`), classUnavailable},
		{"watermill-amqp not connected", errors.New("not connected to AMQP"), classUnavailable},
		{"nats closed", fmt.Errorf("cannot publish: %w", errors.New("nats: connection closed")), classUnavailable},
		{"deadline is the record's", fmt.Errorf("publish: %w", context.DeadlineExceeded), classRecord},
		{"publish timeout is the record's", ErrPublishTimeout, classRecord},
		{"permanent wins", Permanent(Unavailable(base)), classPermanent},
	}
	for _, c := range cases {
		if got := classify(c.err); got != c.want {
			t.Errorf("%s: classify(%v) = %d, want %d", c.name, c.err, got, c.want)
		}
	}
	if !errors.Is(Permanent(base), base) || !errors.Is(Unavailable(base), base) {
		t.Error("the class wrappers hide the error they wrap")
	}
	if Permanent(nil) != nil || Unavailable(nil) != nil {
		t.Error("a class wrapper of nil is not nil")
	}
}
