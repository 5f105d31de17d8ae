// txoutbox console: the only script, served from the binary. It refreshes
// the overview's live section; every page works without it.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) {
    return;
  }
  var src = live.getAttribute("data-src");
  var every = parseInt(live.getAttribute("data-interval"), 10) || 5000;
  var busy = false;
  function refresh() {
    if (busy || document.hidden) {
      return;
    }
    busy = true;
    fetch(src, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) {
        if (!r.ok) {
          throw new Error("HTTP " + r.status);
        }
        return r.text();
      })
      .then(function (html) {
        // The fragment is rendered by html/template on the same origin;
        // the page's CSP forbids inline script either way.
        live.innerHTML = html;
        live.removeAttribute("data-stale");
      })
      .catch(function () {
        live.setAttribute("data-stale", "true");
      })
      .then(function () {
        busy = false;
      });
  }
  setInterval(refresh, Math.max(every, 100));
})();
