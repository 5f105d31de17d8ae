package readme

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var quotedFrom = regexp.MustCompile(`^<!-- quoted from (\S+\.go) -->$`)

// TestReadmeSnippetsAreCompiledCode checks that every Go block of the README
// is quoted from a Go file of the module, so that the compiler has checked
// it: each block follows a line "<!-- quoted from PATH -->", and its lines
// are a run of PATH's lines as written, indented or not.
func TestReadmeSnippetsAreCompiledCode(t *testing.T) {
	root := filepath.Join("..", "..")
	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	blocks := goBlocks(string(readme))
	if len(blocks) == 0 {
		t.Fatal("the README has no Go block")
	}
	for _, b := range blocks {
		if b.source == "" {
			t.Errorf("README line %d: a Go block without a <!-- quoted from PATH --> line before it; put the code in a compiled file (an example, or internal/readme/snippets.go) and quote it", b.line)
			continue
		}
		src, err := os.ReadFile(filepath.Join(root, b.source))
		if err != nil {
			t.Errorf("README line %d quotes %s: %v", b.line, b.source, err)
			continue
		}
		if !contains(strings.Split(string(src), "\n"), b.lines) {
			t.Errorf("README line %d: the block is not in %s as written:\n%s", b.line, b.source, strings.Join(b.lines, "\n"))
		}
	}
}

type block struct {
	line   int    // of the opening fence, from 1
	source string // the quoted file, empty when none is named
	lines  []string
}

// goBlocks returns the README's ```go blocks, with the indentation of their
// fence taken off their lines.
func goBlocks(readme string) []block {
	var blocks []block
	lines := strings.Split(readme, "\n")
	for i := 0; i < len(lines); i++ {
		trimmed := strings.TrimLeft(lines[i], " ")
		if trimmed != "```go" {
			continue
		}
		indent := len(lines[i]) - len(trimmed)
		b := block{line: i + 1}
		for j := i - 1; j >= 0; j-- {
			if prev := strings.TrimSpace(lines[j]); prev != "" {
				if m := quotedFrom.FindStringSubmatch(prev); m != nil {
					b.source = m[1]
				}
				break
			}
		}
		for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
			b.lines = append(b.lines, strings.TrimPrefix(lines[i], strings.Repeat(" ", indent)))
		}
		blocks = append(blocks, b)
	}
	return blocks
}

// contains reports whether want is a run of src's lines, each with the same
// number of extra leading tabs (a fragment quoted from inside a function).
func contains(src, want []string) bool {
	if len(want) == 0 {
		return false
	}
	for i := range src {
		extra, ok := strings.CutSuffix(src[i], want[0])
		if !ok || strings.Trim(extra, "\t") != "" || i+len(want) > len(src) {
			continue
		}
		match := true
		for j, w := range want {
			if got := src[i+j]; got != w && got != extra+w && !(w == "" && strings.TrimSpace(got) == "") {
				match = false
				break
			}
		}
		if match {
			return true
		}
	}
	return false
}

// TestContainsRejectsChangedCode checks that the quote check bites: a
// changed line, a reordered run or a different indentation inside the block
// is not a quote.
func TestContainsRejectsChangedCode(t *testing.T) {
	src := strings.Split("func f() error {\n\tx, err := g()\n\tif err != nil {\n\t\treturn err\n\t}\n\treturn h(x)\n}", "\n")
	for _, c := range []struct {
		want []string
		ok   bool
	}{
		{[]string{"x, err := g()", "if err != nil {", "\treturn err", "}"}, true},
		{[]string{"func f() error {", "\tx, err := g()"}, true},
		{[]string{"x, err := g()", "if err != nil {", "return err", "}"}, false},
		{[]string{"x, _ := g()"}, false},
		{[]string{"return h(x)", "x, err := g()"}, false},
	} {
		if got := contains(src, c.want); got != c.ok {
			t.Errorf("contains(%q) = %v, want %v", c.want, got, c.ok)
		}
	}
}
