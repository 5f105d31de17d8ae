package middleware

import (
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/txoutbox/txoutbox"
)

// AttemptFromMessage returns the forwarder's attempt number of msg (1 for the
// first), or 0 when msg carries none.
func AttemptFromMessage(msg *message.Message) int {
	if d, ok := txoutbox.DeliveryFromContext(msg.Context()); ok {
		return d.Record.Attempts
	}
	n, err := strconv.Atoi(msg.Metadata.Get(txoutbox.MetadataAttempt))
	if err != nil || n < 0 {
		return 0
	}
	return n
}

// OutboxIDFromMessage returns the outbox record id behind msg, and false when
// msg carries none.
func OutboxIDFromMessage(msg *message.Message) (int64, bool) {
	if d, ok := txoutbox.DeliveryFromContext(msg.Context()); ok {
		return d.Record.ID, true
	}
	id, err := strconv.ParseInt(msg.Metadata.Get(txoutbox.MetadataOutboxID), 10, 64)
	if err != nil {
		return 0, false
	}
	return id, true
}

// CreatedAtFromMessage returns when the record behind msg was inserted, and
// false when msg carries no such time.
func CreatedAtFromMessage(msg *message.Message) (time.Time, bool) {
	if d, ok := txoutbox.DeliveryFromContext(msg.Context()); ok && !d.Record.CreatedAt.IsZero() {
		return d.Record.CreatedAt, true
	}
	t, err := time.Parse(time.RFC3339Nano, msg.Metadata.Get(txoutbox.MetadataCreatedAt))
	if err != nil {
		return time.Time{}, false
	}
	return t, true
}

// topicOf returns the topic msg is published to by the forwarder, or "" when
// msg is not in a forwarder's chain.
func topicOf(msg *message.Message) string {
	if d, ok := txoutbox.DeliveryFromContext(msg.Context()); ok {
		return d.Topic
	}
	return ""
}
