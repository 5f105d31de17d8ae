package console

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"net/http"
)

// The CSRF defence has two layers. Go's http.CrossOriginProtection refuses
// a POST a browser marks as cross-origin (Sec-Fetch-Site, or Origin against
// Host). Behind it, each form carries a token bound to a per-browser random
// session cookie: HMAC-SHA256 of the cookie under the handler's secret key.
// A forged request can neither read the cookie nor compute the HMAC, and a
// cookie planted by a sibling subdomain does not come with a valid token.

const (
	sessionCookie = "txoutbox_console"
	csrfField     = "csrf_token"
	maxFormBytes  = 64 << 10
)

// csrfToken returns the token of r's session, setting a new session cookie
// when r has none.
func (h *Handler) csrfToken(w http.ResponseWriter, r *http.Request) string {
	session := ""
	if c, err := r.Cookie(sessionCookie); err == nil && len(c.Value) >= 32 {
		session = c.Value
	} else {
		b := make([]byte, 32)
		_, _ = rand.Read(b)
		session = base64.RawURLEncoding.EncodeToString(b)
		http.SetCookie(w, &http.Cookie{ //nolint:gosec // HttpOnly and SameSite=Strict; Secure whenever the request came over TLS (a loopback console is plain HTTP)
			Name:     sessionCookie,
			Value:    session,
			Path:     h.mountPath(r) + "/",
			HttpOnly: true,
			Secure:   r.TLS != nil,
			SameSite: http.SameSiteStrictMode,
		})
	}
	return h.sign(session)
}

func (h *Handler) sign(session string) string {
	m := hmac.New(sha256.New, h.csrfKey)
	m.Write([]byte("txoutbox console csrf\x00"))
	m.Write([]byte(session))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// withCSRF refuses a POST that is cross-origin or lacks the token of its
// session cookie.
func (h *Handler) withCSRF(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := h.cop.Check(r); err != nil {
			h.refuse(w, r, "cross-origin request refused")
			return
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
		if err := r.ParseForm(); err != nil {
			h.renderError(w, r, http.StatusBadRequest, "Bad form", err.Error())
			return
		}
		if !textValues(r.PostForm) {
			h.renderError(w, r, http.StatusBadRequest, "Bad request", notText)
			return
		}
		c, err := r.Cookie(sessionCookie)
		if err != nil || len(c.Value) < 32 {
			h.refuse(w, r, "no console session cookie")
			return
		}
		if !hmac.Equal([]byte(r.PostForm.Get(csrfField)), []byte(h.sign(c.Value))) {
			h.refuse(w, r, "missing or wrong CSRF token")
			return
		}
		next(w, r)
	}
}

func (h *Handler) refuse(w http.ResponseWriter, r *http.Request, why string) {
	h.logger.Info("txoutbox console: action refused", map[string]any{"reason": why, "path": r.URL.Path, "actor": h.actor(r)})
	h.renderError(w, r, http.StatusForbidden, "Request refused", "The action was refused ("+why+"). Go back, reload the page and confirm again.")
}
