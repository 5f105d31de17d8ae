package postgres

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/txoutbox/txoutbox/internal/migfiles"
	"github.com/txoutbox/txoutbox/storage"
)

// ListenProbeTimeout is how long [Storage.Diagnose] waits for its own
// notification before it concludes that LISTEN does not work on this
// connection (a transaction-mode pooler).
const ListenProbeTimeout = 3 * time.Second

// outboxColumns are the outbox table's columns as the migrations make them.
var outboxColumns = []string{"id", "uuid", "topic", "key", "payload", "metadata", "created_at", "due_at", "attempts",
	"status", "last_error", "delivered_at", "parked", "dead_at", "created_xid"}

// Diagnose implements [storage.Diagnoser]. Its checks:
//
//   - schema version: the version table against [LatestVersion];
//   - schema drift: every table and index the migrations create, and the
//     outbox table's columns, exist;
//   - notify trigger: with [Config.NotifyChannel], the trigger exists and
//     notifies that channel; without it, whether a trigger is there at all;
//   - privileges, of the role the storage connects as: what a forwarder
//     needs (a problem when missing: SELECT, UPDATE and DELETE on the outbox
//     table; SELECT, INSERT, UPDATE and DELETE on the lease and worker
//     tables; SELECT and INSERT on the delivered table; SELECT on the
//     skipped table, which Stats counts), and what only Purge and Skip need
//     (a warning: DELETE on the delivered table, INSERT on the skipped one);
//   - LISTEN: a notification sent to a channel this connection listens on
//     comes back within [ListenProbeTimeout]. It does not behind a
//     transaction-mode pooler (PgBouncer pool_mode=transaction, Supavisor
//     port 6543), which hands the server connection to another client when
//     the LISTEN's transaction ends: the forwarders' Listen then never
//     wakes them, and they fall back to polling.
func (s *Storage) Diagnose(ctx context.Context) ([]storage.Finding, error) {
	var out []storage.Finding
	add := func(check string, sev storage.Severity, format string, args ...any) {
		out = append(out, storage.Finding{Check: check, Severity: sev, Message: fmt.Sprintf(format, args...)})
	}

	ms, err := s.MigrationStatus(ctx)
	if err != nil {
		return nil, err
	}
	out = append(out, migfiles.VersionFinding(ms, s.MigrationTable()))

	// Drift: one catalog read for every object and column.
	var names []string
	var conds []string
	for _, rel := range s.objects() {
		names = append(names, strings.Trim(rel, "'"))
		conds = append(conds, fmt.Sprintf("to_regclass(%s) IS NOT NULL", rel))
	}
	for _, col := range outboxColumns {
		names = append(names, s.table+" column "+col)
		conds = append(conds, fmt.Sprintf(`EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attname = %s AND NOT attisdropped)`,
			lit(s.table), lit(col)))
	}
	present := make([]bool, len(conds))
	if err := s.pool.QueryRow(ctx, "SELECT ARRAY["+strings.Join(conds, ",\n")+"]").Scan(&present); err != nil {
		return nil, fmt.Errorf("diagnose %s: read the catalog: %w", s.table, err)
	}
	var missing []string
	tableMissing := !present[0] // step 1 creates the outbox table first
	for i, ok := range present {
		if !ok && !(tableMissing && strings.Contains(names[i], " column ")) {
			missing = append(missing, strings.ReplaceAll(names[i], `"`, "")+" is missing")
		}
	}
	if len(missing) > 0 {
		add("schema drift", storage.SeverityProblem, "%s (`txoutbox migrate sql` prints the expected schema; `txoutbox migrate up` creates what is missing from a step not yet applied)",
			strings.Join(missing, "; "))
	} else {
		add("schema drift", storage.SeverityOK, "%d tables, indexes and columns as the migrations made them", len(names))
	}

	var hasTrigger bool
	if err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_trigger WHERE tgrelid = to_regclass($1) AND tgname = $2 AND NOT tgisinternal)`,
		s.table, derivedName(s.ident, "notify_trg")).Scan(&hasTrigger); err != nil {
		return nil, fmt.Errorf("diagnose %s: read the notify trigger: %w", s.table, err)
	}
	switch ch := s.config.NotifyChannel; {
	case ch != "":
		var ok bool
		if err := s.pool.QueryRow(ctx, `SELECT `+s.triggerOK()).Scan(&ok); err != nil {
			return nil, fmt.Errorf("diagnose %s: read the notify trigger: %w", s.table, err)
		}
		if ok {
			add("notify trigger", storage.SeverityOK, "notifies channel %s after every insert", ch)
		} else {
			add("notify trigger", storage.SeverityProblem, "missing, or not notifying channel %s: forwarders with Config.NotifyChannel %[1]s are never woken and only poll; run `txoutbox migrate up --notify-channel %[1]s`", ch)
		}
	case hasTrigger:
		add("notify trigger", storage.SeverityOK, "present (pass --notify-channel to check its channel)")
	default:
		add("notify trigger", storage.SeverityOK, "none: forwarders poll (set Config.NotifyChannel and run `txoutbox migrate up --notify-channel NAME` to wake them on insert)")
	}

	// What a forwarder needs (a problem when missing), then what only an
	// operator's Purge and Skip need (a warning).
	type need struct {
		table, priv string
		forwarder   bool
	}
	var needs []need
	for _, n := range []struct {
		table, privs string
		forwarder    bool
	}{
		{s.table, "SELECT, UPDATE, DELETE", true},
		{s.leases, "SELECT, INSERT, UPDATE, DELETE", true},
		{s.delivered, "SELECT, INSERT", true},
		{s.skipped, "SELECT", true},
		{s.delivered, "DELETE", false},
		{s.skipped, "INSERT", false},
	} {
		for _, p := range strings.Split(n.privs, ", ") {
			needs = append(needs, need{n.table, p, n.forwarder})
		}
	}
	var lacking, lackingOps []string
	for _, n := range needs {
		var ok *bool // NULL when the table is missing (reported as drift)
		if err := s.pool.QueryRow(ctx, `SELECT CASE WHEN to_regclass($1) IS NULL THEN NULL ELSE has_table_privilege(to_regclass($1), $2) END`,
			n.table, n.priv).Scan(&ok); err != nil {
			return nil, fmt.Errorf("diagnose %s: read privileges: %w", s.table, err)
		}
		if ok != nil && !*ok {
			what := n.priv + " on " + strings.ReplaceAll(n.table, `"`, "")
			if n.forwarder {
				lacking = append(lacking, what)
			} else {
				lackingOps = append(lackingOps, what)
			}
		}
	}
	var role string
	if err := s.pool.QueryRow(ctx, `SELECT current_user`).Scan(&role); err != nil {
		return nil, fmt.Errorf("diagnose %s: read the role: %w", s.table, err)
	}
	switch {
	case len(lacking) > 0:
		add("privileges", storage.SeverityProblem, "role %s lacks %s, which a forwarder needs: GRANT them to the forwarders' role", role, strings.Join(lacking, ", "))
	case len(lackingOps) > 0:
		add("privileges", storage.SeverityWarning, "role %s has what a forwarder needs, but lacks %s (Purge and Skip need them)", role, strings.Join(lackingOps, ", "))
	default:
		add("privileges", storage.SeverityOK, "role %s has what a forwarder needs on every table, and Purge and Skip too", role)
	}

	switch ok, err := s.listenWorks(ctx); {
	case err != nil:
		return nil, fmt.Errorf("diagnose %s: LISTEN probe: %w", s.table, err)
	case ok:
		add("LISTEN", storage.SeverityOK, "LISTEN works on this connection (direct, or a session-mode pooler)")
	default:
		add("LISTEN", storage.SeverityWarning,
			"a notification to a channel this connection listens on did not come back within %s: the URL points at a transaction-mode pooler (PgBouncer pool_mode=transaction, Supavisor port 6543), where LISTEN does not work. Forwarders still run, polling; to wake them on insert, give Storage.Listen a pool on a direct or session-mode URL (Supavisor port 5432), and keep the transaction-mode URL for Claim and the producers", ListenProbeTimeout)
	}
	return out, nil
}

// listenWorks listens on a fresh channel on one connection, notifies it
// from another and waits for the notification.
func (s *Storage) listenWorks(ctx context.Context) (bool, error) {
	var b [8]byte
	_, _ = rand.Read(b[:])
	channel := "txoutbox_probe_" + hex.EncodeToString(b[:])
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return false, err
	}
	// The connection may still listen (a pooler's server connection is
	// shared): it is closed rather than returned.
	defer func() { _ = conn.Hijack().Close(context.WithoutCancel(ctx)) }()
	if _, err := conn.Exec(ctx, "LISTEN "+channel); err != nil {
		return false, err
	}
	if _, err := s.pool.Exec(ctx, "SELECT pg_notify($1, 'probe')", channel); err != nil {
		return false, err
	}
	wctx, cancel := context.WithTimeout(ctx, ListenProbeTimeout)
	defer cancel()
	n, err := conn.Conn().WaitForNotification(wctx)
	switch {
	case err == nil:
		return n.Channel == channel, nil
	case errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil:
		return false, nil
	default:
		return false, err
	}
}
