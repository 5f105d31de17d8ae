// Package txoutbox is a Transactional Outbox relay for Watermill.
//
// A service writes its business rows and its events in one database
// transaction: the [Publisher] is a Watermill message.Publisher whose Publish
// inserts one outbox record per message through that transaction and never
// talks to a broker. A [Forwarder] claims leased batches of those records from a
// storage.Storage and re-publishes them to any Watermill publisher (Kafka,
// RabbitMQ, NATS, HTTP, ...), at least once and in order per key.
//
// # Delivery semantics
//
//   - At-least-once: a crash between publish and ack redelivers the record after
//     its lease expires. The message UUID is stable across retries: it is the
//     consumer's deduplication key.
//   - Ordered per key: records that share a key are published one after
//     another in id order; a failure holds back the rest of its key (released
//     untried, no attempt burned). With a strict-ordering storage this holds
//     across retries and across forwarders. Keyless records are independent.
//   - Leases bound duplicates: the forwarder renews the leases of the records it
//     holds and publishes a record only while its lease outlasts the publish,
//     so a duplicate needs a crash, a lost ack or a hung publish. Such a
//     redelivery can arrive after later records of its key: a consumer that
//     deduplicates by UUID sees the ordered stream.
//   - Retry times use the application clock and are compared with the
//     database's clock.
//
// The root package never imports a database driver: storages live in
// storage/postgres, storage/mysql (MySQL and MariaDB), storage/sqlite and
// storage/memory.
package txoutbox
