// Package console is an embeddable web console for a txoutbox outbox table:
// an [http.Handler] a service mounts on its admin mux, and what the
// `txoutbox console` command serves.
//
// It shows an overview (records pending, leased, dead, delivered and
// skipped, the age of the oldest pending record, the forwarders seen, and
// throughput and lag over the last minutes as a chart that refreshes by
// itself), the keys held back and why, and the dead letters, filtered by
// topic, key and error text, each record with its payload, metadata, error
// and attempts. With actions turned on it re-drives one record, a key or a
// filtered set, and skips a dead record, each after a confirmation page and
// with an audit line in the log.
//
// It is built on [storage.Operator], like the txoutbox command, so it works
// on every storage that implements it (PostgreSQL, MySQL, SQLite, memory);
// a storage that only reports [storage.StatsReader] gets the overview, and
// the other pages say why they are missing. Its links, forms and redirects
// are relative to the page, so it works mounted on a mux under
// Config.Prefix or under [http.StripPrefix].
//
// # Security
//
// The pages are rendered on the server with html/template, which escapes
// every value from the table; the only script is a small file served from
// the binary, and the Content-Security-Policy forbids any other (and
// framing). The console is read-only unless Config.EnableActions is set;
// Config.Authorize is required and is asked before anything else. Every
// action is a POST that must pass Go's [http.CrossOriginProtection] and
// carry a token bound to a per-browser session cookie (an HMAC under the
// handler's key). Lists are paged with the storage's own limits, and a
// payload over Config.PayloadLimit is cut, with a download link; JSON is
// indented only when that keeps it within a few times its size. A value
// that is not text (a NUL, bytes that are not UTF-8) is a 400, and every
// text field it logs has its control characters escaped, so nothing a
// producer stored or a request sent can forge a log line.
//
// See docs/console.md for the options and the security model in full.
package console
