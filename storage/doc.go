// Package storage is the contract between the txoutbox relay and the table that
// holds the outbox records.
//
// The relay never touches SQL itself: it claims leased batches, then writes back
// the outcome of each record through the methods of [Storage], naming each
// record by the claim that returned it ([ClaimRef]). Adapters live
// in sub-packages (storage/postgres, storage/sqlite, storage/memory), and
// storage/storagetest is the contract suite every adapter, including your own,
// runs from its go test.
//
// # The rules
//
//  1. Claim returns due, unleased, pending records in insertion (id) order, leases
//     them to the worker until now+lease, and increments attempts at claim time,
//     so a crash mid-batch burns an attempt.
//  2. Ack, Nack, Release, DeadLetter and Extend only touch a record while the
//     lease its [ClaimRef] names is the record's lease: leased by the calling
//     worker, with the attempts that claim returned (fencing, below). Records
//     leased by someone else, records claimed again since, and unknown ids
//     are ignored silently.
//  3. Ack marks records delivered. Nack records the error and schedules a retry.
//     Release gives records back with attempts-1 and no error: the relay never
//     tried them. DeadLetter parks a record for good.
//  4. Strict ordering (optional, on in the built-in adapters): a record is held
//     back while an earlier pending record with the same key is not claimable
//     right now. Records with an empty key are never held back.
//
// # Fencing
//
// A write-back is fenced on the claim, not only on the worker. A forwarder
// can hold one record twice: its lease runs out while a write-back of the
// first claim is still on its way (a slow Release behind a database
// hiccup), and the same forwarder claims the record again. Fenced on the
// worker alone, the late write-back would end the new lease; the new claim
// would then publish a record no longer leased, and another forwarder
// could claim and publish it at the same time. So every write-back names
// its records by [ClaimRef], the id and the attempts the claim returned,
// and a storage applies it only where both the worker and the attempts
// still match: in SQL, "WHERE id = ? AND leased_by = ? AND attempts = ?".
// A storage that keeps the attempts of the live claim with its lease (the
// built-in ones do) needs no other column.
//
// Why the attempts tell the claims of one worker apart: each claim adds one
// to a record's attempts and only Release takes one off again, its own
// claim's. So two claims of a record return the same attempts only when
// every claim from the first up to the second ended in a Release, the
// first one included: that Release had landed before the second claim,
// since nothing else makes the record claimable again with the same
// attempts. The forwarder sends at most one Ack, Nack, Release or
// DeadLetter per claim of a record, so no stale one of the first claim is
// left to arrive; every write-back that can arrive late comes from a claim
// whose lease ran out and was taken by a claim with higher attempts, and
// matches nothing.
//
// Two cases are outside that argument, and both are harmless or bounded.
// An Extend of the first claim sent before its Release and landing after
// the second claim pushes out the lease the same worker holds: it keeps
// the record with its holder and never publishes, ends or hands over
// anything. And a re-drive resets attempts to 0: a write-back delayed past
// the record's lease, another worker's claim, its dead-letter, an
// operator's re-drive and a new claim of the first worker with the same
// attempts would match; the forwarder gives up on a write-back after
// BookkeepingTimeout (10s by default), which all of that would have to fit
// in.
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
