// Package storage is the contract between the txoutbox relay and the table that
// holds the outbox records.
//
// The relay never touches SQL itself: it claims leased batches, then writes back
// the outcome of each record through the five methods of [Storage]. Adapters live
// in sub-packages (storage/postgres, storage/sqlite, storage/memory), and
// storage/storagetest is the contract suite every adapter, including your own,
// runs from its go test.
//
// # The rules
//
//  1. Claim returns due, unleased, pending records in insertion (id) order, leases
//     them to the worker until now+lease, and increments attempts at claim time,
//     so a crash mid-batch burns an attempt.
//  2. Ack, Nack, Release and DeadLetter only touch records currently leased by the
//     given worker (fencing). Records leased by someone else, records whose lease
//     expired and was taken over, and unknown ids are ignored silently.
//  3. Ack marks records delivered. Nack records the error and schedules a retry.
//     Release gives records back with attempts-1 and no error: the relay never
//     tried them. DeadLetter parks a record for good.
//  4. Strict ordering (optional, on in the built-in adapters): a record is held
//     back while an earlier pending record with the same key is not claimable
//     right now. Records with an empty key are never held back.
//
// # Optional interfaces
//
// Storages may also implement [StatsReader] (the metrics), [Inserter] (the
// transactional publisher), [Maintainer] (purge, re-drive), [Operator] (what
// the txoutbox command and an admin endpoint need: held keys, dead letters,
// one record, skip), [Migrator] (versioned migrations), [Diagnoser]
// (doctor), [Membership] (key slots shared among forwarders) and
// [DrainClaimer] (claims that tell they left nothing claimable out, by which
// a caught-up forwarder paces its claims). A storage that holds keys on dead-letter keeps rule 4 with dead
// records counted as not claimable, until they are re-driven or skipped.
//
// The interface is meant to be implemented by users and is kept stable: every
// method takes a context and one parameter struct, so the contract can grow new
// optional fields without breaking implementations.
package storage
