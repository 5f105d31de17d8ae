package console

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// TestOverviewShowsInbox: over a SQL storage the overview shows the inbox
// table's entries and the age of its oldest; over one without an inbox
// table (memory), nothing of it.
func TestOverviewShowsInbox(t *testing.T) {
	for _, sd := range seeders {
		t.Run(sd.name, func(t *testing.T) {
			s, _ := sd.seed(t, deadRec{topic: "orders", key: "k1", payload: "x"})
			h := newHandler(t, s, Config{})
			in, ok := s.(interface{ Inbox() storage.InboxStore })
			if !ok {
				if _, body := get(t, h, "GET", "/live"); strings.Contains(body, "inbox") {
					t.Fatalf("a storage without an inbox shows one:\n%s", body)
				}
				return
			}
			ctx := context.Background()
			for i, at := range []time.Time{time.Now().Add(-2 * time.Hour), time.Now()} {
				tx, seen, err := in.Inbox().BeginInbox(ctx, storage.InboxParams{Consumer: "billing", UUID: t.Name() + string(rune('a'+i)), ReceivedAt: at})
				if err != nil || seen {
					t.Fatal(seen, err)
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
			}
			_, body := get(t, h, "GET", "/live")
			for _, want := range []string{`<div class="num">2</div><div class="label">inbox entries</div>`, `<div class="num">2h`, "oldest inbox entry"} {
				if !strings.Contains(body, want) {
					t.Fatalf("overview lacks %q:\n%s", want, body)
				}
			}
		})
	}
}
