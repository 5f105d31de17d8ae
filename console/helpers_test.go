package console

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"go.uber.org/goleak"

	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/memory"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// spy wraps an Operator and counts its calls, to prove which requests reach
// the storage.
type spy struct {
	storage.Operator
	mu       sync.Mutex
	calls    []string
	limits   []int
	redrives []storage.RedriveParams
}

func (s *spy) note(name string) {
	s.mu.Lock()
	s.calls = append(s.calls, name)
	s.mu.Unlock()
}

func (s *spy) Calls() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.calls...)
}

func (s *spy) Stats(ctx context.Context) (storage.Stats, error) {
	s.note("Stats")
	return s.Operator.Stats(ctx)
}

func (s *spy) HeldKeys(ctx context.Context, p storage.HeldKeysParams) ([]storage.HeldKey, error) {
	s.note("HeldKeys")
	s.mu.Lock()
	s.limits = append(s.limits, p.Limit)
	s.mu.Unlock()
	return s.Operator.HeldKeys(ctx, p)
}

func (s *spy) ListDead(ctx context.Context, p storage.ListDeadParams) ([]storage.RecordInfo, error) {
	s.note("ListDead")
	s.mu.Lock()
	s.limits = append(s.limits, p.Limit)
	s.mu.Unlock()
	return s.Operator.ListDead(ctx, p)
}

func (s *spy) Record(ctx context.Context, id int64) (storage.RecordInfo, error) {
	s.note("Record")
	return s.Operator.Record(ctx, id)
}

func (s *spy) Redrive(ctx context.Context, p storage.RedriveParams) (int64, error) {
	s.note("Redrive")
	s.mu.Lock()
	s.redrives = append(s.redrives, p)
	s.mu.Unlock()
	return s.Operator.Redrive(ctx, p)
}

func (s *spy) Skip(ctx context.Context, p storage.SkipParams) error {
	s.note("Skip")
	return s.Operator.Skip(ctx, p)
}

func (s *spy) Purge(ctx context.Context, d time.Duration) (int64, error) {
	s.note("Purge")
	return s.Operator.Purge(ctx, d)
}

// deadRec is a record to seed; dead ones are dead-lettered with err.
type deadRec struct {
	topic, key, payload string
	meta                map[string]string
	dead                bool
	err                 string
}

// testStore is a built-in storage as the tests use it.
type testStore interface {
	storage.Storage
	storage.Operator
}

// seeders are the built-in storages the handler tests run on.
var seeders = []struct {
	name string
	seed func(t *testing.T, recs ...deadRec) (testStore, []int64)
}{{"memory", seed}, {"sqlite", seedSQLite}, {"postgres", seedPostgres}, {"mysql", seedMySQL}}

func records(recs []deadRec) []storage.Record {
	var in []storage.Record
	for i, r := range recs {
		in = append(in, storage.Record{UUID: fmt.Sprintf("uuid-%d-%d", i, time.Now().UnixNano()),
			Topic: r.topic, Key: r.key, Payload: []byte(r.payload), Metadata: r.meta})
	}
	return in
}

// seed adds the records to a memory storage holding keys on dead-letter,
// dead-letters the dead ones and leaves the rest pending, and returns
// their ids.
func seed(t *testing.T, recs ...deadRec) (testStore, []int64) {
	t.Helper()
	s := memory.New(memory.Config{HoldOnDeadLetter: true})
	ids := s.Add(records(recs)...)
	deadLetter(t, s, ids, recs)
	return s, ids
}

// seedSQLite does what seed does on a fresh SQLite database.
func seedSQLite(t *testing.T, recs ...deadRec) (testStore, []int64) {
	t.Helper()
	db, err := sqlite.Open(filepath.Join(t.TempDir(), "outbox.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	s, err := sqlite.New(db, sqlite.Config{HoldOnDeadLetter: true})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	var ids []int64
	if len(recs) > 0 {
		tx, err := db.Begin()
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Insert(ctx, tx, records(recs)); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		for i := range recs { // a fresh table numbers its records from 1
			ids = append(ids, int64(i+1))
		}
		deadLetter(t, s, ids, recs)
	}
	return s, ids
}

// deadLetter claims every record and dead-letters those marked dead,
// releasing the rest untried.
func deadLetter(t *testing.T, s storage.Storage, ids []int64, recs []deadRec) {
	t.Helper()
	ctx := context.Background()
	claimed, err := s.Claim(ctx, storage.ClaimParams{BatchSize: 10_000, Lease: time.Minute, WorkerID: "seed"})
	if err != nil {
		t.Fatal(err)
	}
	if len(claimed) != len(ids) {
		t.Fatalf("claimed %d records to seed, want %d", len(claimed), len(ids))
	}
	var release []storage.ClaimRef
	for i, id := range ids {
		ref := storage.ClaimRef{ID: id, Attempt: 1} // each record's first claim
		if recs[i].dead {
			if err := s.DeadLetter(ctx, storage.DeadLetterParams{Record: ref, WorkerID: "seed", Error: recs[i].err}); err != nil {
				t.Fatal(err)
			}
		} else {
			release = append(release, ref)
		}
	}
	if len(release) > 0 {
		if err := s.Release(ctx, storage.ReleaseParams{Records: release, WorkerID: "seed", RetryAt: time.Now()}); err != nil {
			t.Fatal(err)
		}
	}
}

func newHandler(t *testing.T, store storage.StatsReader, c Config) *Handler {
	t.Helper()
	if c.Authorize == nil {
		c.Authorize = AllowAll
	}
	h, err := New(store, c, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	return h
}

// get serves one request straight through the handler.
func get(t *testing.T, h http.Handler, method, target string) (*http.Response, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(method, target, nil))
	res := rec.Result()
	b, _ := io.ReadAll(res.Body)
	return res, string(b)
}

// browser is a client with a cookie jar against a test server, posting
// like a same-origin browser form would.
type browser struct {
	t      *testing.T
	srv    *httptest.Server
	client *http.Client
}

func newBrowser(t *testing.T, h http.Handler) *browser {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	jar, _ := cookiejar.New(nil)
	return &browser{t: t, srv: srv, client: &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error {
		return http.ErrUseLastResponse
	}}}
}

func (b *browser) do(method, path string, form url.Values, header map[string]string) (*http.Response, string) {
	b.t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, b.srv.URL+path, body)
	if err != nil {
		b.t.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	res, err := b.client.Do(req)
	if err != nil {
		b.t.Fatal(err)
	}
	defer func() { _ = res.Body.Close() }()
	out, _ := io.ReadAll(res.Body)
	return res, string(out)
}

var tokenRE = regexp.MustCompile(`name="csrf_token" value="([^"]+)"`)

// token opens a confirmation page and returns its CSRF token.
func (b *browser) token(path string) string {
	b.t.Helper()
	res, body := b.do("GET", path, nil, nil)
	if res.StatusCode != http.StatusOK {
		b.t.Fatalf("GET %s: %d\n%s", path, res.StatusCode, body)
	}
	m := tokenRE.FindStringSubmatch(body)
	if m == nil {
		b.t.Fatalf("GET %s: no csrf_token in the form:\n%s", path, body)
	}
	return m[1]
}

func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func captured(l *watermill.CaptureLoggerAdapter, level watermill.LogLevel, msg string) []watermill.CapturedMessage {
	var out []watermill.CapturedMessage
	for _, m := range l.Captured()[level] {
		if m.Msg == msg {
			out = append(out, m)
		}
	}
	return out
}
