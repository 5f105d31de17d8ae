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

// bin reads a text column as its stored bytes (utf8mb4), whatever the
// connection's character set: results in a binary string are never
// converted, so a pool whose DSN says charset=utf8 or latin1 reads back
// exactly what was written. JSON goes through its utf8mb4 text (MySQL 8
// stores JSON in a binary format of its own).
func bin(expr string) string { return "CAST(" + expr + " AS BINARY)" }

// binJSON is bin for a JSON column.
func binJSON(expr string) string { return "CAST(CONVERT(" + expr + " USING utf8mb4) AS BINARY)" }

// exactly writes " AND col = v" so that it matches v byte for byte:
// utf8mb4_bin is a PAD SPACE collation ('a' = 'a '), so the length must
// match too. The equality keeps the column's index usable.
func exactly(b *strings.Builder, col, v string) {
	b.WriteString(" AND " + col + " = ")
	strLit(b, v)
	b.WriteString(" AND LENGTH(" + col + ") = " + strconv.Itoa(len(v)))
}
