// Package migfiles reads the numbered schema steps the SQL storages embed,
// and reports a database's schema version as a doctor finding: the parts
// of their migrations that do not depend on the database.
package migfiles

import (
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/txoutbox/txoutbox/storage"
)

// Step is one numbered schema step, its SQL as written in the files
// (placeholders not yet replaced).
type Step struct {
	Version  int
	Name     string
	Up, Down string
}

// Load reads migrations/NNN_name.up.sql (and NNN_name.down.sql where
// reverting is safe, and every later step has one) from fsys, in version
// order. The files are embedded,
// so a gap or a bad name is a build mistake: it panics, naming owner.
func Load(fsys fs.FS, owner string) []Step {
	files, err := fs.Glob(fsys, "migrations/*.up.sql")
	if err != nil {
		panic(err)
	}
	var steps []Step
	for _, f := range files {
		base := strings.TrimSuffix(path.Base(f), ".up.sql")
		num, name, ok := strings.Cut(base, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v != len(steps)+1 {
			panic(fmt.Sprintf("%s migrations: %s is not step %d", owner, f, len(steps)+1))
		}
		up, _ := fs.ReadFile(fsys, f)
		down, _ := fs.ReadFile(fsys, strings.TrimSuffix(f, ".up.sql")+".down.sql")
		steps = append(steps, Step{Version: v, Name: name, Up: string(up), Down: string(down)})
	}
	// A down step runs only on a schema at its version (golang-migrate,
	// goose and `txoutbox migrate sql --down` go down from the latest step):
	// one below a step without a down would run with later steps in place,
	// leave their versions recorded, and so a schema the version misstates.
	for i := 1; i < len(steps); i++ {
		if steps[i].Down == "" && steps[i-1].Down != "" {
			panic(fmt.Sprintf("%s migrations: step %d has a down step but step %d, after it, has none", owner, i, i+1))
		}
	}
	return steps
}

// VersionFinding is the doctor's "schema version" finding for a database at
// ms, whose version table is versionTable.
func VersionFinding(ms storage.MigrationStatus, versionTable string) storage.Finding {
	f := storage.Finding{Check: "schema version", Severity: storage.SeverityProblem}
	switch {
	case ms.Current == ms.Latest:
		f.Severity, f.Message = storage.SeverityOK, fmt.Sprintf("version %d, the latest", ms.Current)
	case ms.Current > ms.Latest:
		f.Message = fmt.Sprintf("version %d is newer than this build's %d: upgrade txoutbox", ms.Current, ms.Latest)
	case ms.Current == 0:
		f.Message = fmt.Sprintf("no version recorded in %s (never migrated): run `txoutbox migrate up`", versionTable)
	default:
		f.Message = fmt.Sprintf("version %d, latest is %d: run `txoutbox migrate up`", ms.Current, ms.Latest)
	}
	return f
}

// Table is a table a step creates: its name as the step writes it
// (placeholders not yet replaced, quotes kept) and the columns it declares.
type Table struct {
	Name    string
	Columns []string
}

var createTableRE = regexp.MustCompile(`(?s)CREATE TABLE IF NOT EXISTS (\S+) \(\n(.*?)\n\)`)

// Tables returns the tables the steps create with CREATE TABLE IF NOT
// EXISTS, in order. A line of a table's body declares a column unless it
// is a comment or starts a key, constraint or check.
func Tables(steps []Step) []Table {
	var out []Table
	for _, st := range steps {
		for _, m := range createTableRE.FindAllStringSubmatch(st.Up, -1) {
			t := Table{Name: m[1]}
			for _, line := range strings.Split(m[2], "\n") {
				f := strings.Fields(line)
				if len(f) == 0 || strings.HasPrefix(f[0], "--") {
					continue
				}
				switch strings.ToUpper(f[0]) {
				case "PRIMARY", "KEY", "UNIQUE", "INDEX", "CONSTRAINT", "CHECK", "FOREIGN":
					continue
				}
				t.Columns = append(t.Columns, strings.Trim(f[0], "`\""))
			}
			out = append(out, t)
		}
	}
	return out
}

// CheckColumns returns an error naming the columns of want that have
// lacks (compared without case), saying that table, which exists, is not
// the table a step would create: CREATE TABLE IF NOT EXISTS would keep it,
// and Migrate would record the step as done on a table the storage cannot
// use. It returns nil when nothing is missing.
func CheckColumns(table string, want, have []string) error {
	var missing []string
	for _, c := range want {
		if !slices.ContainsFunc(have, func(h string) bool { return strings.EqualFold(h, c) }) {
			missing = append(missing, c)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s exists but has no column %s; rename or drop it, or give the outbox another table name",
		storage.ErrNotOutboxTable, table, strings.Join(missing, ", "))
}
