package migfiles

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/txoutbox/txoutbox/storage"
)

func TestTables(t *testing.T) {
	steps := []Step{{Version: 1, Up: "-- c\nCREATE TABLE IF NOT EXISTS {table} (\n    id BIGINT NOT NULL,\n    -- a comment\n    `key` TEXT,\n    status TEXT\n                 CHECK (status IN ('a')),\n    PRIMARY KEY (id),\n    KEY k (status),\n    CONSTRAINT c CHECK (1)\n) ENGINE=InnoDB;\nCREATE INDEX IF NOT EXISTS i ON {table} (id);\n"},
		{Version: 2, Up: "CREATE TABLE IF NOT EXISTS \"{table}_skipped\" (\n    id INTEGER PRIMARY KEY,\n    reason TEXT\n);\n"}}
	got := Tables(steps)
	if len(got) != 2 || got[0].Name != "{table}" || !slices.Equal(got[0].Columns, []string{"id", "key", "status"}) ||
		got[1].Name != `"{table}_skipped"` || !slices.Equal(got[1].Columns, []string{"id", "reason"}) {
		t.Fatalf("Tables = %+v", got)
	}
}

func TestCheckColumns(t *testing.T) {
	if err := CheckColumns("t", []string{"id", "key"}, []string{"ID", "key", "extra"}); err != nil {
		t.Fatalf("CheckColumns of a table with every column = %v", err)
	}
	err := CheckColumns("t", []string{"id", "uuid", "key"}, []string{"id", "note"})
	if !errors.Is(err, storage.ErrNotOutboxTable) || !strings.Contains(err.Error(), "t exists but has no column uuid, key") {
		t.Fatalf("CheckColumns of another table = %v", err)
	}
}

// TestLoadRefusesAMiddleDown: a down step below a step without one could
// only run with the later steps in place.
func TestLoadRefusesAMiddleDown(t *testing.T) {
	fsys := fstest.MapFS{
		"migrations/001_a.up.sql":   {Data: []byte("a")},
		"migrations/002_b.up.sql":   {Data: []byte("b")},
		"migrations/002_b.down.sql": {Data: []byte("-b")},
		"migrations/003_c.up.sql":   {Data: []byte("c")},
	}
	defer func() {
		if r := recover(); r == nil || !strings.Contains(fmt.Sprint(r), "step 2 has a down step but step 3, after it, has none") {
			t.Fatalf("Load of a middle down step: panic %v", r)
		}
	}()
	Load(fsys, "test")
}
