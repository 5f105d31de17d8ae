package txoutbox

import (
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
)

// MetadataDeliverAt holds a message's earliest delivery time, RFC 3339 (with
// or without fractional seconds): the transactional publisher stores it as
// the record's due time, and no forwarder claims the record before it. Set
// it with DeliverAt or Delay. The name is reserved to this meaning: Publish
// refuses a message whose value is not such a time. The metadata stays on
// the message, so the consumer sees it.
//
// Watermill's own delay metadata (delay.Message, the delay.NewPublisher
// wrapper: delay.DelayedUntilKey) is honoured the same way when
// MetadataDeliverAt is absent.
//
// Under strict ordering a record that is not due yet holds back the later
// records of its key, as one waiting for a retry does: they are delivered
// after it, in order. Keyless records are independent: a delayed one holds
// back nothing. A record whose time has passed is due at once. The times
// are the application's clock, compared with the database's; a record
// becomes claimable at its time and goes out with the forwarder's next
// claim (within ForwarderConfig.PollMax when the forwarder is idle).
const MetadataDeliverAt = "txoutbox_deliver_at"

// DeliverAt sets the message's earliest delivery time (MetadataDeliverAt).
func DeliverAt(msg *message.Message, t time.Time) {
	if msg.Metadata == nil {
		msg.Metadata = make(message.Metadata)
	}
	msg.Metadata.Set(MetadataDeliverAt, t.UTC().Format(time.RFC3339Nano))
}

// Delay sets the message's earliest delivery time to d from now
// (MetadataDeliverAt).
func Delay(msg *message.Message, d time.Duration) {
	DeliverAt(msg, time.Now().Add(d))
}

// deliverAt returns the delivery time the message's metadata asks for, zero
// when none.
func deliverAt(msg *message.Message) (time.Time, error) {
	name := MetadataDeliverAt
	v := msg.Metadata.Get(name)
	if v == "" {
		name = delay.DelayedUntilKey
		v = msg.Metadata.Get(name)
	}
	if v == "" {
		return time.Time{}, nil
	}
	t, err := time.Parse(time.RFC3339Nano, v)
	if err != nil {
		return time.Time{}, fmt.Errorf("%w: metadata %q must be an RFC 3339 time (set it with txoutbox.DeliverAt), got %q", ErrInvalidMessage, name, v)
	}
	return t, nil
}
