// Package storagetest is the contract suite for [storage.Storage]
// implementations: lease expiry, fencing, concurrent claims, retry scheduling,
// release, dead-letter, attempts accounting and, for storages that promise it,
// strict ordering under a race. Every built-in adapter runs it; so should
// yours.
//
// # Running it against your storage
//
// From a _test.go file of your package, describe how to make an empty storage
// and how to fill it, then call [Run]:
//
//	func TestContract(t *testing.T) {
//		storagetest.Run(t, storagetest.Harness{
//			New: func(t *testing.T) storage.Storage {
//				return mystorage.New(freshTable(t)) // drop it in t.Cleanup
//			},
//			Insert: func(t *testing.T, s storage.Storage, records ...storage.Record) []int64 {
//				return insertCommitted(t, s.(*mystorage.Storage), records)
//			},
//			Inspect:        inspect, // optional: reads status, attempts, error, lease
//			StrictOrdering: true,    // only if the storage promises it
//			Parallel:       true,    // each case gets its own storage from New
//		})
//	}
//
// Each case is a subtest with a name that says what it checks, such as
// Fencing/AckAfterTakeoverIgnored, so go test -run selects a few; a failure
// says what the storage got wrong and which rule it broke.
//
// # What it needs
//
// Only the standard library and the storage package. The cases that wait for
// a lease or a retry use [Harness.ShortLease] (250ms by default) and poll with
// a deadline, so the suite takes a few seconds; run it with -race. Cases that
// read stored errors and statuses are skipped without [Harness.Inspect], the
// strict-ordering cases without [Harness.StrictOrdering], the Stats,
// Maintenance and Operator cases unless the storage implements
// [storage.StatsReader], [storage.Maintainer] or [storage.Operator] (or
// [Harness.Operator] returns one), and the HoldOnDeadLetter cases without
// [Harness.NewHoldOnDeadLetter].
//
// The suite uses the application clock (time.Now) for RetryAt and to judge
// what happened too early, so the storage's clock must agree with it: a
// database on the same machine does.
package storagetest
