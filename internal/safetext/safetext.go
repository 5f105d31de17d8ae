// Package safetext makes text that came from a producer or a request safe
// to print on an operator's terminal or in a log line: no control
// character, bidirectional override or invalid UTF-8 reaches the output
// raw, so such text can neither move the cursor, retitle the window, nor
// start a line of its own that looks like a row or an audit line.
package safetext

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// safe reports whether r prints as itself on one line: a graphic character
// (letters, marks, numbers, punctuation, symbols, spaces of category Zs).
// Control characters (C0, DEL, C1), format characters (bidirectional
// overrides and isolates, zero-width characters), line and paragraph
// separators, private-use and unassigned code points are not.
func safe(r rune) bool { return r != utf8.RuneError && unicode.IsGraphic(r) }

// clean reports whether s is valid UTF-8 made of safe characters only.
func clean(s string) bool {
	for i, r := range s {
		if !safe(r) {
			// U+FFFD itself is graphic; only a decoding error is unsafe.
			if r == utf8.RuneError {
				if _, size := utf8.DecodeRuneInString(s[i:]); size == 3 {
					continue
				}
			}
			return false
		}
	}
	return true
}

// Escape returns s with every unsafe character written as a Go escape (\n,
// \t, \x1b, \u202e, \xff for a byte that is not UTF-8), and the rest as
// is. It is for free text: error messages, payloads, metadata values,
// reasons. A backslash is kept as it is, so the result is for reading, not
// for decoding.
func Escape(s string) string {
	if clean(s) {
		return s
	}
	q := strconv.QuoteToGraphic(s)
	// Unquote the quotes and backslashes QuoteToGraphic escaped, keeping its
	// escapes of unsafe characters.
	var b strings.Builder
	body := q[1 : len(q)-1]
	for i := 0; i < len(body); i++ {
		if body[i] == '\\' && i+1 < len(body) && (body[i+1] == '"' || body[i+1] == '\\') {
			b.WriteByte(body[i+1])
			i++
			continue
		}
		b.WriteByte(body[i])
	}
	return b.String()
}

// Quote returns s as is when it is made of safe characters and holds no
// double quote or backslash, and else as a Go string literal, double
// quotes included (strconv.QuoteToGraphic). It is for names an operator
// acts on (keys, topics, worker ids): what it prints stands for exactly
// one value.
func Quote(s string) string {
	if clean(s) && !strings.ContainsAny(s, `"\`) {
		return s
	}
	return strconv.QuoteToGraphic(s)
}

// JSON escapes, as \uXXXX, the unsafe characters encoding/json leaves raw
// in the JSON text b (it escapes those below U+0020, U+2028 and U+2029,
// not DEL, C1 controls nor bidirectional overrides). The result decodes to the
// same values. Bytes outside strings are ASCII, and stay.
func JSON(b []byte) []byte {
	var out []byte
	for i := 0; i < len(b); {
		r, size := utf8.DecodeRune(b[i:])
		if (r < utf8.RuneSelf && r != 0x7f) || safe(r) || (r == utf8.RuneError && size == 3) {
			if out != nil {
				out = append(out, b[i:i+size]...)
			}
			i += size
			continue
		}
		if out == nil {
			out = append(make([]byte, 0, len(b)+16), b[:i]...)
		}
		if r == utf8.RuneError { // not UTF-8: encoding/json never writes it
			r = unicode.ReplacementChar
		}
		if r > 0xFFFF {
			r1, r2 := utf16Pair(r)
			out = append(out, `\u`+hex4(r1)+`\u`+hex4(r2)...)
		} else {
			out = append(out, `\u`+hex4(r)...)
		}
		i += size
	}
	if out == nil {
		return b
	}
	return out
}

func utf16Pair(r rune) (rune, rune) {
	r -= 0x10000
	return 0xD800 + (r>>10)&0x3FF, 0xDC00 + r&0x3FF
}

func hex4(r rune) string {
	const digits = "0123456789abcdef"
	return string([]byte{digits[r>>12&0xF], digits[r>>8&0xF], digits[r>>4&0xF], digits[r&0xF]})
}
