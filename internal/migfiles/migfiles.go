// Package migfiles reads the numbered schema steps the SQL storages embed,
// and reports a database's schema version as a doctor finding: the parts
// of their migrations that do not depend on the database.
package migfiles

import (
	"fmt"
	"io/fs"
	"path"
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
// reverting is safe) from fsys, in version order. The files are embedded,
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
