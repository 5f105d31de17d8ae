// Package brokers holds txoutbox's end-to-end tests against real Watermill
// brokers: Kafka (an in-process kfake cluster), RabbitMQ, NATS JetStream, and
// Watermill's CQRS event bus. It has no non-test code; it lives apart from the
// root package so that the root never imports a broker client.
//
// The tests read the services from the environment, with local defaults:
// TEST_DATABASE_URL, AMQP_URL, NATS_URL. Outside CI a missing service skips its
// tests with a hint on how to start it; with CI=true they fail instead.
package brokers
