// Package faulttest is txoutbox's fault-tolerance suite. Its tests build the
// cmd/txoutbox-fault binary, run several forwarder processes against one
// PostgreSQL outbox table while producers write, and inject faults: SIGKILL
// mid-batch, SIGTERM, terminated database backends, a PostgreSQL restart, and
// a target that fails or hangs. Afterwards they prove that nothing committed
// was lost, nothing rolled back was delivered, per-key order held, and every
// duplicate has a fault that explains it. See docs/reliability.md.
//
// The non-test part of the package is the wire format between the worker
// binary and the recording HTTP target in the test process.
package faulttest

// Delivery is what the worker binary POSTs to the target for each message.
type Delivery struct {
	// UUID is the Watermill message UUID.
	UUID string `json:"uuid"`
	// Topic is the topic the message was published to.
	Topic string `json:"topic"`
	// Key is the outbox ordering key, empty for a keyless record.
	Key string `json:"key,omitempty"`
	// OutboxID is the record's id in the outbox table.
	OutboxID int64 `json:"outbox_id"`
	// Attempt is the forwarder's attempt number, 1 for the first.
	Attempt int `json:"attempt"`
	// Worker is the worker id of the forwarder that published it.
	Worker string `json:"worker"`
	// Payload is the message payload.
	Payload []byte `json:"payload"`
}

// HeaderWorker carries the worker id on every request, so the target can tell
// who is calling before it decodes the body.
const HeaderWorker = "X-Txoutbox-Worker"

// LogOutcomeUnknown starts the line the worker writes to stderr when a
// publish was cut off at its deadline after the request was sent: the target
// may have recorded it, so a redelivery is an expected duplicate.
const LogOutcomeUnknown = "fault-worker: publish outcome unknown"

// ApplicationNamePrefix starts the application_name of every database
// connection the suite opens, so its backends can be told apart from other
// clients of the server (and terminated on purpose).
const ApplicationNamePrefix = "txoutbox-fault"
