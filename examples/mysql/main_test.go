package main

import (
	"bytes"
	"cmp"
	"context"
	"database/sql"
	"os"
	"strings"
	"testing"
	"time"
)

// TestMySQLExample runs the example against TEST_MYSQL_DSN: every committed
// event is printed, the rolled-back one never is.
func TestMySQLExample(t *testing.T) {
	dsn := cmp.Or(os.Getenv("TEST_MYSQL_DSN"), "root@tcp(127.0.0.1:3306)/test")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if db, err := sql.Open("mysql", dsn); err == nil {
		err = db.PingContext(ctx)
		db.Close()
		if err != nil {
			msg := "MySQL not reachable at TEST_MYSQL_DSN: " + err.Error() + "; start it with: start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd"
			if os.Getenv("CI") == "true" {
				t.Fatal(msg)
			}
			t.Skip(msg)
		}
	}
	var out bytes.Buffer
	if err := run(ctx, dsn, &out); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	text := out.String()
	if got := strings.Count(text, "delivered orders."); got != 6 {
		t.Errorf("%d deliveries printed, want 6 (3 committed orders x 2 events):\n%s", got, text)
	}
	if strings.Contains(text, "mallory") {
		t.Errorf("the rolled-back order's event was delivered:\n%s", text)
	}
	if !strings.Contains(text, "all 6 committed events delivered") {
		t.Errorf("missing the final line:\n%s", text)
	}
}
