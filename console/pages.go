package console

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/txoutbox/txoutbox/storage"
)

// ---- overview ----

type overviewData struct {
	Stats      storage.Stats
	Err        string
	At         time.Time
	Throughput chart
	Lag        chart
	IntervalMS int64
	Interval   time.Duration
	OpWhy      string // set when the storage has no Operator
	// Inbox is the inbox table's stats, nil without one; InboxAge the age
	// of its oldest entry.
	Inbox    *storage.InboxStats
	InboxAge time.Duration
}

func (h *Handler) overviewData(ctx context.Context) overviewData {
	h.sampler.viewed() //nolint:contextcheck // the sampler lives as long as the handler, not the request
	d := overviewData{IntervalMS: h.config.SampleInterval.Milliseconds(), Interval: h.config.SampleInterval, OpWhy: h.opWhy}
	if s, ok := h.sampler.latest(h.config.SampleInterval); ok {
		d.Stats, d.At = s.stats, s.at
	} else if st, err := h.stats.Stats(ctx); err != nil {
		h.logger.Error("txoutbox console: read stats", err, nil)
		d.Err = err.Error()
	} else {
		d.Stats, d.At = st, time.Now()
	}
	if h.inbox != nil && d.Err == "" {
		if st, err := h.inbox.InboxStats(ctx); err != nil {
			h.logger.Error("txoutbox console: read inbox stats", err, nil)
			d.Err = err.Error()
		} else {
			d.Inbox = &st
			if !st.Oldest.IsZero() {
				d.InboxAge = max(time.Since(st.Oldest), 0)
			}
		}
	}
	window := time.Duration(h.config.Samples) * h.config.SampleInterval
	d.Throughput, d.Lag = charts(h.sampler.samples(), window, h.config.SampleInterval, time.Now())
	return d
}

func (h *Handler) overview(w http.ResponseWriter, r *http.Request) {
	h.render(w, http.StatusOK, "overview", h.newPage(r, "overview", h.overviewData(r.Context())))
}

// live is the overview's changing part, which console.js fetches every
// SampleInterval.
func (h *Handler) live(w http.ResponseWriter, r *http.Request) {
	h.renderTemplate(w, http.StatusOK, "overview", "live", h.newPage(r, "overview", h.overviewData(r.Context())))
}

// ---- held keys ----

type heldData struct {
	Keys    []storage.HeldKey
	After   string
	Limit   int
	Next    string
	HasNext bool
}

func (h *Handler) held(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	d := heldData{After: q.Get("after"), Limit: h.limit(q)}
	keys, err := h.op.HeldKeys(r.Context(), storage.HeldKeysParams{AfterKey: d.After, Limit: d.Limit + 1})
	if err != nil {
		h.storageError(w, r, "list held keys", err)
		return
	}
	if len(keys) > d.Limit {
		keys, d.HasNext = keys[:d.Limit], true
		d.Next = keys[len(keys)-1].Key
	}
	d.Keys = keys
	h.render(w, http.StatusOK, "held", h.newPage(r, "held", d))
}

// ---- dead letters ----

type deadData struct {
	Topic, Key, Error string
	After             int64
	Limit             int
	Rows              []storage.RecordInfo
	Next              int64
	HasNext           bool
	Filtered          bool
}

func (h *Handler) dead(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	d := deadData{Topic: q.Get("topic"), Key: q.Get("key"), Error: q.Get("error"), Limit: h.limit(q)}
	d.After, _ = strconv.ParseInt(q.Get("after"), 10, 64)
	d.Filtered = d.Topic != "" || d.Key != "" || d.Error != ""
	rows, err := h.op.ListDead(r.Context(), storage.ListDeadParams{Topic: d.Topic, Key: d.Key, ErrorContains: d.Error,
		AfterID: max(0, d.After), Limit: d.Limit + 1})
	if err != nil {
		h.storageError(w, r, "list dead records", err)
		return
	}
	if len(rows) > d.Limit {
		rows, d.HasNext = rows[:d.Limit], true
		d.Next = rows[len(rows)-1].Record.ID
	}
	d.Rows = rows
	p := h.newPage(r, "dead", d)
	if n, err := strconv.ParseInt(q.Get("redriven"), 10, 64); err == nil {
		p.Flash = "Re-drove " + plural(n, "dead record", "dead records") + "."
	}
	h.render(w, http.StatusOK, "dead", p)
}

// limit is the page size the URL asks for, bounded.
func (h *Handler) limit(q url.Values) int {
	n, err := strconv.Atoi(q.Get("limit"))
	if err != nil || n < 1 {
		return h.config.PageSize
	}
	return min(n, MaxPageSize)
}

// ---- one record ----

type recordData struct {
	R        storage.RecordInfo
	Payload  payloadView
	Metadata []kv
	IsDead   bool
}

func (h *Handler) recordFromPath(w http.ResponseWriter, r *http.Request) (storage.RecordInfo, bool) {
	id, err := strconv.ParseInt(r.PathValue("id"), 10, 64)
	if err != nil || id <= 0 {
		h.renderError(w, r, http.StatusNotFound, "No such record", "A record id is a positive integer.")
		return storage.RecordInfo{}, false
	}
	return h.recordByID(w, r, id)
}

func (h *Handler) recordByID(w http.ResponseWriter, r *http.Request, id int64) (storage.RecordInfo, bool) {
	rec, err := h.op.Record(r.Context(), id)
	if errors.Is(err, storage.ErrRecordNotFound) {
		h.renderError(w, r, http.StatusNotFound, "No such record", fmt.Sprintf("Record %d is not in the table (never inserted, or purged).", id))
		return rec, false
	}
	if err != nil {
		h.storageError(w, r, fmt.Sprintf("read record %d", id), err)
		return rec, false
	}
	return rec, true
}

func (h *Handler) record(w http.ResponseWriter, r *http.Request) {
	rec, ok := h.recordFromPath(w, r)
	if !ok {
		return
	}
	d := recordData{R: rec, Payload: viewPayload(rec.Record.Payload, h.config.PayloadLimit),
		Metadata: sortedMetadata(rec.Record.Metadata), IsDead: rec.Status == storage.StatusDead}
	p := h.newPage(r, "dead", d)
	q := r.URL.Query()
	if n, err := strconv.ParseInt(q.Get("redriven"), 10, 64); err == nil {
		p.Flash = "Re-drove " + plural(n, "dead record", "dead records") + "."
	} else if q.Get("skipped") == "1" {
		p.Flash = "Record skipped."
	}
	h.render(w, http.StatusOK, "record", p)
}

// payload sends the payload as a file, whatever it holds: it is never
// rendered by the browser.
func (h *Handler) payload(w http.ResponseWriter, r *http.Request) {
	rec, ok := h.recordFromPath(w, r)
	if !ok {
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", fmt.Sprintf(`attachment; filename="outbox-record-%d.bin"`, rec.Record.ID))
	w.Header().Set("Content-Length", strconv.Itoa(len(rec.Record.Payload)))
	_, _ = w.Write(rec.Record.Payload)
}

// ---- actions ----

// redriveReq selects what a re-drive changes: one record, or the dead
// records matching a filter (All: every one).
type redriveReq struct {
	ID                int64
	Topic, Key, Error string
	All               bool
}

func parseRedrive(v url.Values) (redriveReq, error) {
	q := redriveReq{Topic: v.Get("topic"), Key: v.Get("key"), Error: v.Get("error"), All: v.Get("all") == "1"}
	if s := v.Get("id"); s != "" {
		id, err := strconv.ParseInt(s, 10, 64)
		if err != nil || id <= 0 {
			return q, fmt.Errorf("id %q: want a positive integer", s)
		}
		q.ID = id
	}
	filtered := q.Topic != "" || q.Key != "" || q.Error != ""
	switch {
	case q.ID > 0 && (filtered || q.All):
		return q, errors.New("give an id or a filter, not both")
	case q.All && filtered:
		return q, errors.New("all=1 re-drives every dead record: give no filter with it")
	case q.ID == 0 && !filtered && !q.All:
		return q, errors.New("nothing selected: give an id, a topic, key or error filter, or all=1")
	}
	return q, nil
}

// by names the selection in the audit line.
func (q redriveReq) by() string {
	switch {
	case q.ID > 0:
		return "id"
	case q.All:
		return "all"
	case q.Error == "" && q.Topic == "":
		return "key"
	case q.Error == "" && q.Key == "":
		return "topic"
	}
	return "filter"
}

func (q redriveReq) describe() string {
	if q.ID > 0 {
		return fmt.Sprintf("dead record %d", q.ID)
	}
	if q.All {
		return "every dead record"
	}
	var parts []string
	if q.Topic != "" {
		parts = append(parts, fmt.Sprintf("topic is %q", q.Topic))
	}
	if q.Key != "" {
		parts = append(parts, fmt.Sprintf("key is %q", q.Key))
	}
	if q.Error != "" {
		parts = append(parts, fmt.Sprintf("error contains %q", q.Error))
	}
	return "every dead record whose " + strings.Join(parts, " and ")
}

func (q redriveReq) fields() []kv {
	var f []kv
	add := func(k, v string) {
		if v != "" {
			f = append(f, kv{k, v})
		}
	}
	if q.ID > 0 {
		add("id", strconv.FormatInt(q.ID, 10))
	}
	add("topic", q.Topic)
	add("key", q.Key)
	add("error", q.Error)
	if q.All {
		add("all", "1")
	}
	return f
}

// back is where the operator returns after the action, from a page whose
// way to the console's root is root.
func (q redriveReq) back(root string) string {
	if q.ID > 0 {
		return fmt.Sprintf("%s/records/%d", root, q.ID)
	}
	v := url.Values{}
	for _, f := range q.fields() {
		if f.K != "all" {
			v.Set(f.K, f.V)
		}
	}
	if len(v) == 0 {
		return root + "/dead"
	}
	return root + "/dead?" + v.Encode()
}

type confirmData struct {
	Action  string // the form's path: redrive or skip
	Heading string
	What    string
	Count   string // how many records, "" when not counted
	Record  *storage.RecordInfo
	Fields  []kv
	Back    string
	Blocked string // why there is nothing to confirm
	Reason  bool   // the form asks for a reason (skip)
	Err     string
}

func (h *Handler) redriveConfirm(w http.ResponseWriter, r *http.Request) {
	q, err := parseRedrive(r.URL.Query())
	if err != nil {
		h.renderError(w, r, http.StatusBadRequest, "Nothing to re-drive", err.Error())
		return
	}
	d := confirmData{Action: "redrive", Heading: "Re-drive", What: q.describe(), Fields: q.fields(), Back: q.back(root(r.URL.Path))}
	if q.ID > 0 {
		rec, ok := h.recordByID(w, r, q.ID)
		if !ok {
			return
		}
		d.Record = &rec
		if rec.Status != storage.StatusDead {
			d.Blocked = fmt.Sprintf("Record %d is %s, not dead: there is nothing to re-drive.", q.ID, rec.Status)
		}
	} else {
		ids, more, err := h.deadIDs(r.Context(), q, h.config.FilteredRedriveLimit)
		if err != nil {
			h.storageError(w, r, "count dead records", err)
			return
		}
		d.Count = strconv.Itoa(len(ids))
		if more {
			d.Count = "more than " + d.Count
		}
		if len(ids) == 0 {
			d.Blocked = "No dead record matches: there is nothing to re-drive."
		}
	}
	p := h.newPage(r, "dead", d)
	p.CSRF = h.csrfToken(w, r)
	h.render(w, http.StatusOK, "confirm", p)
}

func (h *Handler) redrive(w http.ResponseWriter, r *http.Request) {
	q, err := parseRedrive(r.PostForm)
	if err != nil {
		h.renderError(w, r, http.StatusBadRequest, "Nothing to re-drive", err.Error())
		return
	}
	ctx := r.Context()
	var n int64
	switch q.by() {
	case "id":
		n, err = h.op.Redrive(ctx, storage.RedriveParams{IDs: []int64{q.ID}})
	case "all":
		n, err = h.op.Redrive(ctx, storage.RedriveParams{All: true})
	case "key":
		n, err = h.op.Redrive(ctx, storage.RedriveParams{Key: q.Key})
	case "topic":
		n, err = h.op.Redrive(ctx, storage.RedriveParams{Topic: q.Topic})
	default: // a filter the storage cannot apply itself: list the ids, bounded
		var ids []int64
		if ids, _, err = h.deadIDs(ctx, q, h.config.FilteredRedriveLimit); err == nil {
			for chunk := range slices.Chunk(ids, 1000) {
				var m int64
				if m, err = h.op.Redrive(ctx, storage.RedriveParams{IDs: chunk}); err != nil {
					break
				}
				n += m
			}
		}
	}
	fields := map[string]any{"action": "redrive", "by": q.by(), "count": n, "actor": h.actor(r), "remote_addr": r.RemoteAddr}
	for _, f := range q.fields() {
		fields[f.K] = f.V
	}
	if err != nil {
		fields["count"] = n
		h.logger.Error("txoutbox console: re-drive failed", err, fields)
		h.renderError(w, r, http.StatusInternalServerError, "Re-drive failed", fmt.Sprintf("Re-drove %d record(s), then: %v", n, err))
		return
	}
	h.logger.Info("txoutbox console: re-drive", fields)
	back := q.back(root(r.URL.Path))
	sep := "?"
	if strings.Contains(back, "?") {
		sep = "&"
	}
	h.redirect(w, r, back+sep+"redriven="+strconv.FormatInt(n, 10), http.StatusSeeOther)
}

// deadIDs lists the ids of the dead records q's filter selects, in id
// order, at most limit; more reports that there are more.
func (h *Handler) deadIDs(ctx context.Context, q redriveReq, limit int) (ids []int64, more bool, err error) {
	var after int64
	for {
		want := min(1000, limit-len(ids)+1)
		page, err := h.op.ListDead(ctx, storage.ListDeadParams{Topic: q.Topic, Key: q.Key, ErrorContains: q.Error,
			AfterID: after, Limit: want})
		if err != nil {
			return nil, false, err
		}
		for _, rec := range page {
			if len(ids) == limit {
				return ids, true, nil
			}
			ids = append(ids, rec.Record.ID)
			after = rec.Record.ID
		}
		if len(page) < want {
			return ids, false, nil
		}
	}
}

func (h *Handler) skipData(w http.ResponseWriter, r *http.Request, idText string) (confirmData, bool) {
	id, err := strconv.ParseInt(idText, 10, 64)
	if err != nil || id <= 0 {
		h.renderError(w, r, http.StatusBadRequest, "Nothing to skip", "Give the id of a dead record.")
		return confirmData{}, false
	}
	rec, ok := h.recordByID(w, r, id)
	if !ok {
		return confirmData{}, false
	}
	d := confirmData{Action: "skip", Heading: "Skip", Record: &rec, Reason: true,
		What:   fmt.Sprintf("dead record %d: it will never be delivered, and no longer holds back key %q", id, rec.Record.Key),
		Fields: []kv{{"id", strconv.FormatInt(id, 10)}}, Back: fmt.Sprintf("%s/records/%d", root(r.URL.Path), id)}
	if rec.Status != storage.StatusDead {
		d.Blocked = fmt.Sprintf("Record %d is %s, not dead: only a dead record can be skipped.", id, rec.Status)
	}
	return d, true
}

func (h *Handler) skipConfirm(w http.ResponseWriter, r *http.Request) {
	d, ok := h.skipData(w, r, r.URL.Query().Get("id"))
	if !ok {
		return
	}
	p := h.newPage(r, "dead", d)
	p.CSRF = h.csrfToken(w, r)
	h.render(w, http.StatusOK, "confirm", p)
}

func (h *Handler) skip(w http.ResponseWriter, r *http.Request) {
	reason := strings.TrimSpace(r.PostForm.Get("reason"))
	if reason == "" {
		d, ok := h.skipData(w, r, r.PostForm.Get("id"))
		if !ok {
			return
		}
		d.Err = "Give a reason: it is kept with the record as the audit record."
		p := h.newPage(r, "dead", d)
		p.CSRF = h.csrfToken(w, r)
		h.render(w, http.StatusBadRequest, "confirm", p)
		return
	}
	id, err := strconv.ParseInt(r.PostForm.Get("id"), 10, 64)
	if err != nil || id <= 0 {
		h.renderError(w, r, http.StatusBadRequest, "Nothing to skip", "Give the id of a dead record.")
		return
	}
	fields := map[string]any{"action": "skip", "id": id, "reason": reason, "actor": h.actor(r), "remote_addr": r.RemoteAddr}
	err = h.op.Skip(r.Context(), storage.SkipParams{ID: id, Reason: reason})
	switch {
	case errors.Is(err, storage.ErrRecordNotFound):
		h.renderError(w, r, http.StatusNotFound, "No such record", err.Error())
		return
	case errors.Is(err, storage.ErrNotDead):
		h.renderError(w, r, http.StatusConflict, "Not dead", err.Error())
		return
	case err != nil:
		h.logger.Error("txoutbox console: skip failed", err, fields)
		h.renderError(w, r, http.StatusInternalServerError, "Skip failed", err.Error())
		return
	}
	h.logger.Info("txoutbox console: skip", fields)
	h.redirect(w, r, fmt.Sprintf("%s/records/%d?skipped=1", root(r.URL.Path), id), http.StatusSeeOther)
}
