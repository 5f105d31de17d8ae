package mysql

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"

	"github.com/go-sql-driver/mysql"

	"github.com/txoutbox/txoutbox/storage"
)

// findings runs Diagnose and returns check -> finding.
func findings(t *testing.T, s *Storage) map[string]storage.Finding {
	t.Helper()
	fs, err := s.Diagnose(t.Context())
	must(t, err)
	out := map[string]storage.Finding{}
	for _, f := range fs {
		out[f.Check] = f
	}
	return out
}

func TestDiagnose(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	got := findings(t, s)
	for _, check := range []string{"schema version", "schema drift", "privileges", "server version"} {
		if f := got[check]; f.Severity != storage.SeverityOK {
			t.Errorf("%s on a fresh table: %+v, want ok", check, f)
		}
	}
	if _, ok := got["binary log"]; !ok {
		t.Errorf("no binary log finding: %+v", got)
	}

	must(t, exec(t, s, "CREATE INDEX extra_idx ON "+s.table+" (topic)"))
	if f := findings(t, s)["schema drift"]; f.Severity != storage.SeverityWarning || !strings.Contains(f.Message, "extra_idx") {
		t.Errorf("schema drift with an extra index: %+v, want a warning naming it", f)
	}
	must(t, exec(t, s, "ALTER TABLE "+s.table+" DROP INDEX done_idx, DROP INDEX key_idx, ADD INDEX key_idx (`key`, id)"))
	f := findings(t, s)["schema drift"]
	if f.Severity != storage.SeverityProblem || !strings.Contains(f.Message, "index done_idx of") || !strings.Contains(f.Message, "index key_idx of "+s.table+" differs: found (key, id), expected (key, status, id)") {
		t.Errorf("schema drift without done_idx and with key_idx changed: %+v, want a problem naming both", f)
	}
	must(t, exec(t, s, "DROP TABLE "+s.SkippedTable()))
	must(t, exec(t, s, "DELETE FROM "+s.MigrationTable()+" WHERE version >= 2"))
	got = findings(t, s)
	if f := got["schema drift"]; f.Severity != storage.SeverityProblem || !strings.Contains(f.Message, s.SkippedTable()+" is missing") {
		t.Errorf("schema drift without the skipped table: %+v", f)
	}
	if f := got["schema version"]; f.Severity != storage.SeverityProblem || !strings.Contains(f.Message, fmt.Sprintf("version 1, latest is %d", LatestVersion())) {
		t.Errorf("schema version one step behind: %+v", f)
	}
}

// TestDiagnosePrivileges connects as a user that may only read the outbox
// table: the privileges check names what it lacks.
func TestDiagnosePrivileges(t *testing.T) {
	t.Parallel()
	s := newStore(t, Config{})
	var b [4]byte
	_, _ = rand.Read(b[:])
	user := "txo_ro_" + hex.EncodeToString(b[:])
	must(t, exec(t, s, "CREATE USER '"+user+"'@'%' IDENTIFIED BY 'ro-pass'"))
	t.Cleanup(func() { _, _ = s.db.ExecContext(context.Background(), "DROP USER '"+user+"'@'%'") })
	var dbName string
	must(t, s.db.QueryRowContext(t.Context(), "SELECT DATABASE()").Scan(&dbName))
	must(t, exec(t, s, "GRANT SELECT ON `"+dbName+"`.* TO '"+user+"'@'%'"))

	cfg, err := mysql.ParseDSN(testDSN())
	must(t, err)
	cfg.User, cfg.Passwd = user, "ro-pass"
	db, err := sql.Open("mysql", cfg.FormatDSN())
	must(t, err)
	t.Cleanup(func() { _ = db.Close() })
	ro, err := New(db, Config{Table: s.name})
	must(t, err)
	f := findings(t, ro)["privileges"]
	if f.Severity != storage.SeverityProblem {
		t.Fatalf("privileges of a read-only user: %+v, want a problem", f)
	}
	// SELECT ... FOR UPDATE needs UPDATE or DELETE too on MySQL 8, not on
	// MariaDB.
	for _, want := range []string{"INSERT on " + s.table + " denied", "UPDATE on", "DELETE on", "INSERT on " + s.SkippedTable()} {
		if !strings.Contains(f.Message, want) {
			t.Errorf("privileges finding %q does not name %q", f.Message, want)
		}
	}
}

func TestVersionOK(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]bool{
		"10.11.19-MariaDB-0+deb12u1": true, "10.6.5-MariaDB": true, "10.5.9-MariaDB": false,
		"8.0.36": true, "8.4.0": true, "5.7.44-log": false, "11.4.2-MariaDB": true,
	} {
		if got, _ := versionOK(v); got != want {
			t.Errorf("versionOK(%q) = %v, want %v", v, got, want)
		}
	}
}
