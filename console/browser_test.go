package console

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/chromedp/chromedp"

	"github.com/txoutbox/txoutbox"
	"github.com/txoutbox/txoutbox/storage"
	"github.com/txoutbox/txoutbox/storage/sqlite"
)

var screenshots = flag.Bool("screenshots", false, "write the browser test's screenshots to ../docs/ (else to a temporary directory)")

// browserBackends are the real databases the browser test runs against: a
// fresh outbox holding keys on dead-letter, and a func inserting records in
// one transaction.
var browserBackends = []struct {
	name string
	open func(t *testing.T) (storage.Storage, func(recs []storage.Record))
}{
	{"sqlite", func(t *testing.T) (storage.Storage, func([]storage.Record)) {
		db, err := sqlite.Open(filepath.Join(t.TempDir(), "outbox.db"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		s, err := sqlite.New(db, sqlite.Config{HoldOnDeadLetter: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
		return s, func(recs []storage.Record) {
			tx, err := db.Begin()
			if err != nil {
				t.Error(err)
				return
			}
			if err := s.Insert(context.Background(), tx, recs); err != nil {
				_ = tx.Rollback()
				t.Error(err)
				return
			}
			if err := tx.Commit(); err != nil {
				t.Error(err)
			}
		}
	}},
	{"postgres", openPostgresBrowser},
	{"mysql", func(t *testing.T) (storage.Storage, func([]storage.Record)) {
		s, db := newMySQL(t)
		return s, func(recs []storage.Record) {
			if _, err := insertMySQL(t, s, db, recs); err != nil {
				t.Error(err)
			}
		}
	}},
}

// chromium finds the browser, or skips (outside CI) saying how to get it.
func chromium(t *testing.T) string {
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	msg := "no chromium on PATH: install it (Debian: apt-get install -y chromium) to run the browser test"
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
	return ""
}

// published is what the forwarder's target received.
type published struct {
	mu   sync.Mutex
	msgs []delivered
}

type delivered struct{ id, key, payload string }

func (p *published) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.msgs = append(p.msgs, delivered{m.Metadata.Get(txoutbox.MetadataOutboxID), m.Metadata.Get(txoutbox.MetadataKey), string(m.Payload)})
	}
	return nil
}

func (p *published) Close() error { return nil }

func (p *published) ofKey(key string) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []string
	for _, d := range p.msgs {
		if d.key == key {
			out = append(out, d.payload)
		}
	}
	return out
}

// TestBrowser drives the console in headless Chromium against a real
// database with dead letters while a Forwarder runs: the overview's chart
// refreshes by itself, a hostile payload runs no script, the dead letters
// are filtered, a key is re-driven through its confirmation page, and the
// forwarder delivers the key's records in order.
func TestBrowser(t *testing.T) {
	exe := chromium(t)
	for _, bk := range browserBackends {
		t.Run(bk.name, func(t *testing.T) {
			s, insert := bk.open(t)
			op := s.(storage.Operator)
			testBrowser(t, exe, s, op, insert)
		})
	}
}

func testBrowser(t *testing.T, exe string, s storage.Storage, op storage.Operator, insert func([]storage.Record)) {
	ctx := context.Background()
	rec := func(topic, key, payload string, meta map[string]string) storage.Record {
		return storage.Record{UUID: watermill.NewUUID(), Topic: topic, Key: key, Payload: []byte(payload), Metadata: meta}
	}
	seedRecs := []storage.Record{
		rec("orders.created", "order-7", `{"order":7,"total":"42.00","items":[{"sku":"A-1","qty":2}]}`, map[string]string{"trace_id": "4bf92f35", "tenant": "acme"}),
		rec("orders.paid", "order-7", `{"order":7,"paid":true}`, nil),
		rec("orders.shipped", "order-7", `{"order":7,"carrier":"DHL"}`, nil),
		rec("orders.created", "order-8", `{"order":8,"total":"-1"}`, map[string]string{"tenant": "globex"}),
		rec("orders.paid", "order-8", `{"order":8,"paid":true}`, nil),
		rec("customers.updated", "cust-3", "\x00\x01binary\xff", nil),
		rec("audit.logged", "", `<script>window.__xss=1</script>`, map[string]string{"<b>x</b>": `"><img src=x onerror="window.__xss=2">`}),
	}
	dead := map[int]string{
		0: "publish orders.created: kafka: request timed out (broker 2)",
		3: "publish orders.created: schema registry: field total must be positive",
		5: "publish customers.updated: message too large",
		6: `<img src=x onerror="window.__xss=3">`,
	}
	insert(seedRecs)
	ids := make([]int64, len(seedRecs))
	for id, found := int64(1), 0; found < len(seedRecs) && id < 1000; id++ {
		if r, err := op.Record(ctx, id); err == nil {
			for i, sr := range seedRecs {
				if sr.UUID == r.Record.UUID {
					ids[i] = id
					found++
				}
			}
		}
	}
	var marks []deadRec
	for i := range seedRecs {
		e, ok := dead[i]
		marks = append(marks, deadRec{dead: ok, err: e})
	}
	deadLetter(t, s, ids, marks)

	// A forwarder delivers everything that is not held, and a producer keeps
	// adding keyless records for the chart.
	target := &published{}
	fwd, err := txoutbox.NewForwarder(s, target, txoutbox.ForwarderConfig{
		BatchSize: 50, Lease: 10 * time.Second, PollMin: 10 * time.Millisecond, PollMax: 50 * time.Millisecond,
		StorageErrorDelay: 20 * time.Millisecond, MaxAttempts: 3, WorkerID: "forwarder-1",
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	fctx, stopForwarder := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { _ = fwd.Run(fctx) })
	pctx, stopProducer := context.WithCancel(ctx)
	wg.Go(func() {
		for i := 0; pctx.Err() == nil; i++ {
			var batch []storage.Record
			for j := range 5 + (i*7)%23 {
				batch = append(batch, rec("orders.viewed", "", fmt.Sprintf(`{"view":%d}`, i*100+j), nil))
			}
			insert(batch)
			select {
			case <-pctx.Done():
			case <-time.After(150 * time.Millisecond):
			}
		}
	})
	defer func() {
		stopProducer()
		stopForwarder()
		wg.Wait()
	}()

	logger := watermill.NewCaptureLogger()
	h, err := New(op, Config{Authorize: AllowAll, EnableActions: true, Prefix: "/admin/outbox", Title: "orders-service",
		SampleInterval: 250 * time.Millisecond, Samples: 28, Actor: func(*http.Request) string { return "e2e" }}, logger)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = h.Close() }()
	mux := http.NewServeMux()
	mux.Handle("/admin/outbox/", h)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	base := srv.URL + "/admin/outbox"

	actx, cancelAlloc := chromedp.NewExecAllocator(ctx,
		chromedp.ExecPath(exe),
		chromedp.Flag("headless", true),
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true),
		chromedp.NoFirstRun,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1180, 760),
	)
	defer cancelAlloc()
	bctx, cancelBrowser := chromedp.NewContext(actx)
	defer cancelBrowser()
	if err := chromedp.Do(bctx, chromedp.Navigate(base+"/")); err != nil { // starts the browser: no timeout on this one
		t.Fatal(err)
	}
	defer func() { // close the browser and wait for it
		if err := chromedp.Cancel(bctx); err != nil && !errors.Is(err, context.Canceled) {
			t.Logf("close the browser: %v", err)
		}
	}()
	tctx, cancel := context.WithTimeout(bctx, 5*time.Minute)
	defer cancel()
	do := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(tctx, steps...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	eval := func(expr string) string {
		t.Helper()
		v, err := chromedp.Run(tctx, chromedp.Evaluate[string](expr))
		if err != nil {
			t.Fatalf("evaluate %s: %v", expr, err)
		}
		return v
	}
	shotDir := t.TempDir()
	if *screenshots {
		shotDir = filepath.Join("..", "docs")
	}
	shot := func(name string) {
		t.Helper()
		png, err := chromedp.Run(tctx, chromedp.CaptureScreenshot())
		if err != nil {
			t.Fatalf("screenshot %s: %v", name, err)
		}
		if err := os.WriteFile(filepath.Join(shotDir, name), png, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	// Overview: the numbers, and the live section refreshing by itself
	// (console.js, a file under the CSP) until the chart has a line.
	do("overview", chromedp.WaitVisible(chromedp.CSS("#live svg")))
	if got := eval(`document.querySelector('a.card.bad .num').textContent`); got != "4" {
		t.Fatalf("overview shows %s dead records, want 4", got)
	}
	first := eval(`document.querySelector('#live p.muted').textContent`)
	do("the overview to refresh itself and draw throughput",
		chromedp.Poll[chromedp.Void](`document.querySelector('#live p.muted').textContent !== `+jsString(first)+
			` && document.querySelectorAll('#live .chart:last-child polyline').length >= 1`+ // lag
			` && Array.from(document.querySelectorAll('#live .chart:first-child polyline')).reduce((n, p) => n + p.getAttribute('points').split(' ').length, 0) >= 22`,
			chromedp.WithPollingInterval(100*time.Millisecond), chromedp.WithPollingTimeout(90*time.Second)))
	shot("console-overview.png")
	stopProducer()

	// Dead letters: the hostile payload and error ran no script.
	do("dead letters", chromedp.Navigate(base+"/dead"), chromedp.WaitVisible(chromedp.CSS("table tbody tr")))
	if got := eval(`String(document.querySelectorAll('tbody tr').length)`); got != "4" {
		t.Fatalf("dead letters page lists %s rows, want 4", got)
	}
	shot("console-dead-letters.png")
	do("the hostile record's page", chromedp.Navigate(fmt.Sprintf("%s/records/%d", base, ids[6])), chromedp.WaitVisible(chromedp.ID("payload")))
	if got := eval(`document.getElementById('payload').textContent`); got != `<script>window.__xss=1</script>` {
		t.Fatalf("hostile payload shown as %q, want its text", got)
	}
	if got := eval(`String(typeof window.__xss)`); got != "undefined" {
		t.Fatalf("a hostile value ran script: window.__xss is %s", got)
	}

	// Filter by key, re-drive the key through its confirmation page.
	do("filter by key",
		chromedp.Navigate(base+"/dead"),
		chromedp.WaitVisible(chromedp.CSS(`input[name=key]`)),
		chromedp.SetValue(chromedp.CSS(`input[name=key]`), "order-7"),
		chromedp.Click(chromedp.CSS(`form.filters button[type=submit]`)),
		chromedp.WaitVisible(chromedp.ID("redrive-filtered")),
	)
	if got := eval(`Array.from(document.querySelectorAll('tbody tr td:nth-child(3)')).map(e => e.textContent).join(',')`); got != "order-7" {
		t.Fatalf("filtered by key order-7, the page lists keys %q", got)
	}
	do("re-drive the key",
		chromedp.Click(chromedp.CSS(`td.actions a[href*="redrive?key="]`)),
		chromedp.WaitVisible(chromedp.ID("confirm")),
	)
	if got := eval(`document.getElementById('count').textContent`); got != "1" {
		t.Fatalf("confirmation counts %s records, want 1", got)
	}
	do("confirm", chromedp.Click(chromedp.ID("confirm")), chromedp.WaitVisible(chromedp.CSS("p.flash")))
	if got := eval(`document.querySelector('p.flash').textContent`); got != "Re-drove 1 dead record." {
		t.Fatalf("flash after confirming: %q", got)
	}

	// The forwarder delivers the key, in order; the browser sees it.
	deadline := time.Now().Add(time.Minute)
	for _, i := range []int{0, 2} {
		for {
			do("record page", chromedp.Navigate(fmt.Sprintf("%s/records/%d", base, ids[i])), chromedp.WaitVisible(chromedp.ID("status")))
			if eval(`document.getElementById('status').textContent`) == "delivered" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("record %d not delivered within a minute of the re-drive", ids[i])
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	if got, want := target.ofKey("order-7"), []string{string(seedRecs[0].Payload), string(seedRecs[1].Payload), string(seedRecs[2].Payload)}; !slices.Equal(got, want) {
		t.Fatalf("key order-7 delivered %q, want %q in id order", got, want)
	}
	if got := target.ofKey("order-8"); len(got) != 0 {
		t.Fatalf("key order-8 delivered %q while its head is dead", got)
	}
	do("held keys", chromedp.Navigate(base+"/held"), chromedp.WaitVisible(chromedp.CSS("table")))
	if got := eval(`Array.from(document.querySelectorAll('tbody tr td:first-child')).map(e => e.textContent).join(',')`); got != "cust-3,order-8" {
		t.Fatalf("held keys after the re-drive: %q, want cust-3,order-8 (dead heads), not order-7", got)
	}
	if a := captured(logger, watermill.InfoLogLevel, "txoutbox console: re-drive"); len(a) != 1 || a[0].Fields["key"] != "order-7" || a[0].Fields["actor"] != "e2e" {
		t.Fatalf("audit lines %+v, want one re-drive of key order-7 by e2e", a)
	}
	if *screenshots {
		t.Logf("screenshots written to %s", shotDir)
	}
}

// jsString quotes s for a JavaScript expression.
func jsString(s string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`, "\n", `\n`).Replace(s) + "'"
}
