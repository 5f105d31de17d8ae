package safetext

import (
	"encoding/json"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"
)

// hostile holds what a producer could put in a key, a topic, an error or a
// payload to take over a terminal or forge a line.
var hostile = []string{
	"k3\n4242\tforged-key\tforged.topic\t1",
	"\x1b]0;pwned\x07title",
	"erase\r\x1b[2Kline",
	"nul\x00byte",
	"del\x7f",
	"c1 \u0085 nel \u009b csi",
	"bidi \u202e reversed \u2066 isolate",
	"zero\u200bwidth",
	"line\u2028sep\u2029para",
	"tag \U000e0041",
	"bad utf8 \xff\xfe",
	"\xc0\x80",
}

// unsafeIn returns the first character of s that must not reach a terminal.
func unsafeIn(s string) (rune, bool) {
	for i, r := range s {
		if r == utf8.RuneError {
			if _, size := utf8.DecodeRuneInString(s[i:]); size != 3 {
				return r, true
			}
			continue
		}
		if !unicode.IsGraphic(r) {
			return r, true
		}
	}
	return 0, false
}

func TestEscapeAndQuote(t *testing.T) {
	for _, s := range hostile {
		for name, f := range map[string]func(string) string{"Escape": Escape, "Quote": Quote} {
			got := f(s)
			if r, bad := unsafeIn(got); bad {
				t.Errorf("%s(%q) = %q keeps %U", name, s, got, r)
			}
		}
	}
	for in, want := range map[string]string{
		"plain key-1/ä€😀 with spaces": "plain key-1/ä€😀 with spaces",
		"a\nb":                        `a\nb`,
		"\x1b[31mred":                 `\x1b[31mred`,
		"say \"hi\" \\ \t":            `say "hi" \ \t`,
		"\u202e":                      `\u202e`,
		"\xff":                        `\xff`,
		"\ufffd replacement":          "\ufffd replacement",
	} {
		if got := Escape(in); got != want {
			t.Errorf("Escape(%q) = %q, want %q", in, got, want)
		}
	}
	for in, want := range map[string]string{
		"order-1042":  "order-1042",
		"":            "",
		"a b":         "a b",
		"a\nb":        `"a\nb"`,
		`a\nb`:        `"a\\nb"`, // a backslash is quoted, so the two never print alike
		`"quoted"`:    `"\"quoted\""`,
		"\u202eabc":   `"\u202eabc"`,
		"k\xffk":      `"k\xffk"`,
		"ü-straße-東京": "ü-straße-東京",
	} {
		if got := Quote(in); got != want {
			t.Errorf("Quote(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestJSON(t *testing.T) {
	for _, s := range hostile {
		if !utf8.ValidString(s) {
			continue // encoding/json replaces the bad bytes
		}
		raw, err := json.Marshal(map[string]string{"k": s})
		if err != nil {
			t.Fatal(err)
		}
		got := JSON(raw)
		if r, bad := unsafeIn(string(got)); bad {
			t.Errorf("JSON(%s) = %s keeps %U", raw, got, r)
		}
		var back map[string]string
		if err := json.Unmarshal(got, &back); err != nil || back["k"] != s {
			t.Errorf("JSON(%s) = %s decodes to %q, %v; want %q", raw, got, back["k"], err, s)
		}
	}
	plain := []byte("{\n  \"k\": \"ä 😀\"\n}\n")
	if got := JSON(plain); string(got) != string(plain) {
		t.Errorf("JSON changed plain text: %s", got)
	}
	if !strings.Contains(string(JSON([]byte(`"`+"\U000e0041"+`"`))), `\udb40\udc41`) {
		t.Error("a character beyond the BMP is not escaped as a surrogate pair")
	}
}
