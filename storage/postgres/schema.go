package postgres

import (
	"fmt"
	"hash/fnv"

	"github.com/jackc/pgx/v5"
)

// siblingName is an object named after the table (derivedName) in the
// table's schema, quoted for SQL: "app"."outbox_leases".
func siblingName(table pgx.Identifier, suffix string) string {
	return append(table[:len(table)-1:len(table)-1], derivedName(table, suffix)).Sanitize()
}

// derivedName names an object after the table ("outbox_pending_idx"). Names
// that would pass 63 bytes are shortened with a hash of the table name, because
// the server would truncate them and two indexes could end up with one name.
func derivedName(table pgx.Identifier, suffix string) string {
	base := table[len(table)-1]
	name := base + "_" + suffix
	if len(name) <= maxIdentifierLen {
		return name
	}
	h := fnv.New32a()
	h.Write([]byte(base))
	tag := fmt.Sprintf("%08x", h.Sum32())
	keep := maxIdentifierLen - len(suffix) - len(tag) - 2
	return base[:keep] + "_" + tag + "_" + suffix
}
