package mysql

import (
	"encoding/hex"
	"strconv"
	"strings"
	"time"
)

// Statements are sent as text with their values written in as literals:
// integers in decimal, strings and bytes as hexadecimal literals, which no
// byte sequence can escape from. Without parameters go-sql-driver/mysql
// sends a statement in one round trip; with them it prepares, executes and
// closes a server-side statement (unless the DSN sets interpolateParams),
// and a claim runs several statements.

// strLit is s as a utf8mb4 string literal with a binary collation, so that
// keys compare byte for byte and the key index is usable.
func strLit(b *strings.Builder, s string) {
	if s == "" {
		b.WriteString("''")
		return
	}
	b.WriteString("_utf8mb4 X'")
	b.WriteString(hex.EncodeToString([]byte(s)))
	b.WriteString("' COLLATE utf8mb4_bin")
}

// bytesLit is p as a binary literal, NULL for nil.
func bytesLit(b *strings.Builder, p []byte) {
	if p == nil {
		b.WriteString("NULL")
		return
	}
	b.WriteString("X'")
	b.WriteString(hex.EncodeToString(p))
	b.WriteByte('\'')
}

// idList writes ids as a comma-separated list.
func idList(b *strings.Builder, ids []int64) {
	for i, id := range ids {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(id, 10))
	}
}

// ids returns "1,2,3".
func idsText(ids []int64) string {
	var b strings.Builder
	idList(&b, ids)
	return b.String()
}

// timeLit is t as a DATETIME(6) literal in UTC.
func timeLit(t time.Time) string {
	return "'" + t.UTC().Format("2006-01-02 15:04:05.000000") + "'"
}

// plusMicros is the SQL for a DATETIME expression plus d.
func plusMicros(expr string, d time.Duration) string {
	return expr + " + INTERVAL " + strconv.FormatInt(d.Microseconds(), 10) + " MICROSECOND"
}

// micros reads a DATETIME(6) expression as microseconds since the Unix
// epoch, independent of the DSN's parseTime and loc settings.
func micros(expr string) string {
	return "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', " + expr + ")"
}

func fromMicros(us int64) time.Time { return time.UnixMicro(us).UTC() }
