package txoutbox_test

import (
	"go/parser"
	"go/token"
	"os"
	"strconv"
	"strings"
	"testing"
)

// TestRootImportsNoDriver keeps the root package free of database drivers and
// broker clients: only storage/<adapter> packages and examples import them.
func TestRootImportsNoDriver(t *testing.T) {
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	allowed := []string{"github.com/ThreeDotsLabs/watermill", "github.com/txoutbox/txoutbox/storage"}
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() || !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(token.NewFileSet(), name, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			if !strings.Contains(strings.Split(path, "/")[0], ".") {
				continue // standard library
			}
			ok := false
			for _, a := range allowed {
				ok = ok || path == a || strings.HasPrefix(path, a+"/")
			}
			if !ok || strings.HasPrefix(path, "github.com/txoutbox/txoutbox/storage/") {
				t.Errorf("%s imports %s: the root package may import only Watermill and the storage contract", name, path)
			}
		}
	}
}
