package console_test

import (
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/txoutbox/txoutbox/console"
	"github.com/txoutbox/txoutbox/storage/memory"
)

// isAdmin stands for the application's own authentication: a session
// lookup, a role check.
func isAdmin(r *http.Request) bool {
	c, err := r.Cookie("session")
	return err == nil && c.Value == "alice-admin-session"
}

// Mount the console on the application's admin mux, behind its own
// authorisation, with re-drive and skip turned on. Audit lines go to slog.
func Example() {
	store := memory.New(memory.Config{}) // in a service: sqlite.New(db, ...) or any storage.Operator

	logger := watermill.NewSlogLogger(slog.New(slog.NewJSONHandler(os.Stderr, nil)))
	h, err := console.New(store, console.Config{
		Prefix:        "/admin/outbox",
		Authorize:     isAdmin,
		EnableActions: true,
	}, logger)
	if err != nil {
		panic(err)
	}
	defer func() { _ = h.Close() }() // stops the stats sampler

	admin := http.NewServeMux()
	admin.Handle("/admin/outbox/", h)

	// What the mux answers, for an admin and for anyone else:
	srv := httptest.NewServer(admin)
	defer srv.Close()
	for _, session := range []string{"alice-admin-session", "mallory"} {
		req, _ := http.NewRequest("GET", srv.URL+"/admin/outbox/dead", nil)
		req.AddCookie(&http.Cookie{Name: "session", Value: session})
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			panic(err)
		}
		_ = res.Body.Close()
		fmt.Println(session, res.StatusCode)
	}
	// Output:
	// alice-admin-session 200
	// mallory 403
}
