// Package memory is an in-memory [storage.Storage]: the reference
// implementation of the storage contract, and the example to read before
// writing a storage of your own.
//
// It keeps every record in a slice ordered by id behind one mutex, so each
// method is a short, linear piece of code that states one rule of the contract.
// It implements [storage.Storage], [storage.StatsReader],
// [storage.Maintainer] and [storage.Operator], and passes the whole
// storagetest suite with strict ordering on (the default) and off, and with
// Config.HoldOnDeadLetter.
//
// Nothing survives the process, so it is meant for tests, examples and
// prototypes, not for production: records are inserted with [Storage.Add],
// which commits at once, not inside a database transaction.
//
// # Writing your own storage
//
// The parts worth copying are in [Storage.Claim]:
//
//   - records are scanned in id order and taken while they are pending, due
//     (now is not before their due time) and unleased (now is not before the
//     end of their lease);
//   - with strict ordering, the first pending record of a key that is not
//     claimable right now holds back every later record of that key; records
//     with an empty key are never held back;
//   - attempts go up at claim time, and the lease records the worker, which
//     every write-back then checks (fencing).
//
// Then run storagetest.Run from your package's tests; see that package's
// documentation.
package memory
