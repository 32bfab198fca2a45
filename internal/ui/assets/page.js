// shaper's live page: polls api/state every second and draws each
// vendor's chart as SVG. No library, no build step.
"use strict";

(function () {
  const base = document.body.dataset.base || "";
  const only = document.body.dataset.only || "";
  const SVG = "http://www.w3.org/2000/svg";
  const W = 640, H = 180, PAD_L = 36, PAD_R = 6, PAD_T = 8, PAD_B = 18;

  function el(name, attrs, parent) {
    const e = document.createElementNS(SVG, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }

  function set(section, key, text) {
    const e = section.querySelector('[data-k="' + key + '"]');
    if (e) e.textContent = text;
    return e;
  }

  function dur(seconds) {
    if (!(seconds > 0)) return "0s";
    if (seconds < 1) return Math.round(seconds * 1000) + "ms";
    if (seconds < 60) return (Math.round(seconds * 10) / 10) + "s";
    const m = Math.floor(seconds / 60), s = Math.round(seconds % 60);
    if (m < 60) return m + "m" + (s ? s + "s" : "");
    return Math.floor(m / 60) + "h" + (m % 60 ? (m % 60) + "m" : "");
  }

  function perWindow(rate, w) {
    return (Math.round(rate * 100) / 100) + "/" + (w === "1s" ? "s" : w);
  }

  function clock(iso) {
    const d = new Date(iso);
    return isNaN(d) ? iso : d.toLocaleTimeString();
  }

  // draw renders a vendor's series into its svg: pause bands, the limit
  // (dashed), the effective rate (dotted), the calls started per second
  // (solid) and a red mark under each interval with 429s.
  function draw(svg, v) {
    const s = v.series;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const n = s.t ? s.t.length : 0;
    const t1 = n ? s.t[n - 1] : Date.now();
    const t0 = n ? Math.min(s.t[0], t1 - 60000) : t1 - 60000;
    let ymax = 1;
    for (let i = 0; i < n; i++) ymax = Math.max(ymax, s.started[i], s.limit[i], s.rate[i]);
    ymax = ymax * 1.15;
    const x = (t) => PAD_L + (W - PAD_L - PAD_R) * (t - t0) / Math.max(t1 - t0, 1);
    const y = (val) => PAD_T + (H - PAD_T - PAD_B) * (1 - val / ymax);
    // axes and grid
    for (const f of [0, 0.5, 1]) {
      const val = ymax / 1.15 * f;
      el("line", { x1: PAD_L, x2: W - PAD_R, y1: y(val), y2: y(val), class: "grid" }, svg);
      el("text", { x: PAD_L - 4, y: y(val) + 4, class: "axis", "text-anchor": "end" }, svg).textContent = Math.round(val * 10) / 10;
    }
    el("text", { x: PAD_L, y: H - 4, class: "axis" }, svg).textContent = "-" + dur((t1 - t0) / 1000);
    el("text", { x: W - PAD_R, y: H - 4, class: "axis", "text-anchor": "end" }, svg).textContent = "now";
    for (const p of v.pauses || []) {
      const a = Math.max(x(Date.parse(p.seen) - v.every_ms), PAD_L), b = Math.min(x(Date.parse(p.until)), W - PAD_R);
      if (b > a) {
        el("rect", { x: a, y: PAD_T, width: b - a, height: H - PAD_T - PAD_B, class: "pauseband" }, svg)
          .appendChild(el("title", {})).textContent = "paused until " + clock(p.until) + ": " + p.reason;
      }
    }
    if (n === 0) {
      el("text", { x: W / 2, y: H / 2, class: "axis", "text-anchor": "middle" }, svg).textContent = "collecting samples…";
      svg.dataset.latest = "";
      return;
    }
    const line = (vals, cls) => {
      const pts = [];
      for (let i = 0; i < n; i++) pts.push(x(s.t[i]).toFixed(1) + "," + y(vals[i]).toFixed(1));
      el("polyline", { points: pts.join(" "), class: cls }, svg);
    };
    if (v.limit_per_second > 0) line(s.limit, "limit");
    if (v.rate_per_second > 0) line(s.rate, "rate");
    line(s.started, "started");
    for (let i = 0; i < n; i++) {
      if (s.limited[i] > 0) {
        el("rect", { x: x(s.t[i]) - 2, y: H - PAD_B - 6, width: 4, height: 6, class: "limited" }, svg)
          .appendChild(el("title", {})).textContent = s.limited[i] + " × 429";
      }
    }
    svg.dataset.latest = String(v.started_per_second);
    svg.dataset.points = String(n);
  }

  function why(v) {
    const rate = perWindow(v.effective_rate, v.window);
    const parts = [];
    if (v.source && v.source !== "configured") parts.push("rate " + rate + " set by " + v.source);
    if (v.rate_reason) parts.push(v.rate_reason);
    if (v.guard_reason) parts.push("guard " + dur(v.guard_seconds) + ": " + v.guard_reason);
    if (v.warming_for_seconds > 0) parts.push("warming up, " + dur(v.warming_for_seconds) + " left");
    if (v.replica_rates && v.replica_rates.length) parts.push("replicas disagree on the rate: " + v.replica_rates.join(", ") + "; the lowest applies");
    return parts.length ? parts.join(" — ") : "rate " + rate + " as configured (guard " + dur(v.guard_seconds) + ")";
  }

  function update(section, v) {
    set(section, "source", v.source || "configured");
    const paused = section.querySelector('[data-k="paused"]');
    if (paused) paused.hidden = !(v.paused_for_seconds > 0);
    set(section, "started", v.started_per_second + "/s");
    set(section, "rate", perWindow(v.effective_rate, v.window));
    set(section, "limit", perWindow(v.config_rate, v.window) + (v.accounts_with_backlog !== undefined ? " each account" : ""));
    set(section, "queued", v.queued);
    set(section, "queued_high", v.queued_high);
    set(section, "in_flight", v.in_flight);
    set(section, "requeued", v.requeued);
    set(section, "limited", v.rate_limited_last_minute);
    set(section, "next", dur(v.next_tick_seconds));
    set(section, "oldest", dur(v.oldest_queued_seconds));
    set(section, "why", why(v));
    const pn = section.querySelector('[data-k="pause-now"]');
    if (pn) {
      pn.hidden = !(v.paused_for_seconds > 0);
      pn.textContent = v.paused_for_seconds > 0 ? "Paused for " + dur(v.paused_for_seconds) + " (until " + clock(v.paused_until) + "): " + v.pause_reason : "";
    }
    const q = section.querySelector('[data-k="quotas"]');
    if (q) {
      q.textContent = "";
      for (const u of v.quotas || []) {
        const d = document.createElement("div");
        d.className = "quota";
        const pct = u.rate > 0 ? Math.min(100, 100 * u.used / u.rate) : 0;
        d.innerHTML = '<span class="qname"></span><span class="bar"><span></span></span><span class="qtext"></span>';
        d.querySelector(".qname").textContent = "quota " + u.limit;
        d.querySelector(".bar span").style.width = pct.toFixed(1) + "%";
        d.querySelector(".qtext").textContent = u.used + " used, " + u.left + " left" + (u.next_call_seconds > 0 ? ", next call in " + dur(u.next_call_seconds) : "");
        q.appendChild(d);
      }
    }
    set(section, "pause-count", (v.pauses || []).length);
    const ol = section.querySelector('[data-k="pauses"]');
    if (ol) {
      ol.textContent = "";
      for (const p of (v.pauses || []).slice().reverse()) {
        const li = document.createElement("li");
        li.textContent = clock(p.seen) + " → " + clock(p.until) + ": " + p.reason;
        ol.appendChild(li);
      }
    }
    if (v.accounts_with_backlog !== undefined) {
      set(section, "accounts-backlog", v.accounts_with_backlog);
      if (v.total) set(section, "total", "; total " + v.total.rate + "/" + v.total.window + " over all accounts");
      const tb = section.querySelector('[data-k="top"]');
      if (tb) {
        tb.textContent = "";
        for (const a of v.top_accounts || []) {
          const tr = document.createElement("tr");
          const td1 = document.createElement("td"), td2 = document.createElement("td");
          td1.textContent = a.account;
          td2.textContent = dur(a.backlog_seconds);
          tr.append(td1, td2);
          tb.appendChild(tr);
        }
      }
    }
    const svg = section.querySelector("svg.plot");
    if (svg) draw(svg, v);
    const n = v.series && v.series.t ? v.series.t.length : 0;
    set(section, "span", n ? dur(n * v.every_ms / 1000) : "minutes");
  }

  async function getJSON(path) {
    const r = await fetch(base + path, { cache: "no-store", credentials: "same-origin" });
    let body = null;
    try { body = await r.json(); } catch (e) { body = null; }
    if (!r.ok) throw new Error((body && body.error) || (r.status + " " + r.statusText));
    return body;
  }

  let polling = false;
  async function poll() {
    if (polling) return;
    polling = true;
    const status = document.getElementById("updated");
    const err = document.getElementById("error");
    try {
      const st = await getJSON("api/state" + (only ? "?vendor=" + encodeURIComponent(only) : ""));
      for (const v of st.vendors) {
        v.every_ms = st.every_ms;
        const section = document.querySelector('section.vendor[data-vendor="' + CSS.escape(v.vendor) + '"]');
        if (section) update(section, v);
      }
      err.hidden = !st.error;
      err.textContent = st.error ? "cannot read the gate's state: " + st.error : "";
      status.textContent = "updated " + clock(st.at);
    } catch (e) {
      status.textContent = "page server unreachable: " + e.message;
    } finally {
      polling = false;
    }
  }

  function line(dt, dd, out) {
    const a = document.createElement("dt"), b = document.createElement("dd");
    a.textContent = dt;
    b.textContent = dd;
    out.append(a, b);
  }

  async function explain(ev) {
    ev.preventDefault();
    const id = document.getElementById("explain-id").value.trim();
    const out = document.getElementById("explain-out");
    out.hidden = false;
    out.textContent = "";
    if (!id) { out.textContent = "Give a task id."; return; }
    try {
      const ex = await getJSON("api/explain/" + encodeURIComponent(id));
      const dl = document.createElement("dl");
      line("task", ex.task_id + " (" + ex.vendor + (ex.account ? ", account " + ex.account : "") + ", " + ex.lane + " lane): " + ex.state, dl);
      if (ex.place > 0) line("place", ex.place + " in its lane, " + ex.ahead + " calls start before it", dl);
      line(ex.binding, ex.reason, dl);
      if (ex.estimated_start) line("estimated start", clock(ex.estimated_start) + " (in " + dur((Date.parse(ex.estimated_start) - Date.now()) / 1000) + ")", dl);
      if (ex.retried > 0 || ex.last_error) line("retries", ex.retried + (ex.last_error ? "; last error: " + ex.last_error : ""), dl);
      out.appendChild(dl);
    } catch (e) {
      out.textContent = e.message;
      out.classList.add("error");
      return;
    }
    out.classList.remove("error");
  }

  async function account(ev) {
    ev.preventDefault();
    const form = ev.target;
    const section = form.closest("section.vendor");
    const name = form.elements.account.value.trim();
    const out = section.querySelector(".account-out");
    out.hidden = false;
    out.textContent = "";
    try {
      const v = await getJSON("api/vendors/" + encodeURIComponent(section.dataset.vendor) + "/accounts/" + encodeURIComponent(name));
      const a = v.account;
      const dl = document.createElement("dl");
      line("rate", perWindow(a.effective_rate, a.window) + " (its own limit " + a.config_rate + "/" + a.window + ")", dl);
      if (a.share_rate !== undefined) line("share of the total", "at least " + perWindow(a.share_rate, a.window) + " while " + v.accounts_with_backlog + " account(s) have a backlog", dl);
      if (a.rate_source) line("set by", a.rate_source + (a.rate_reason ? ": " + a.rate_reason : ""), dl);
      line("next tick", dur(a.next_tick_seconds), dl);
      if (a.paused_for_seconds > 0) line("paused", dur(a.paused_for_seconds) + ": " + a.pause_reason, dl);
      for (const u of a.quotas || []) line("quota " + u.limit, u.used + " used, " + u.left + " left", dl);
      out.appendChild(dl);
      out.classList.remove("error");
    } catch (e) {
      out.textContent = e.message;
      out.classList.add("error");
    }
  }

  document.getElementById("explain-form").addEventListener("submit", explain);
  for (const f of document.querySelectorAll(".account-form")) f.addEventListener("submit", account);
  poll();
  setInterval(poll, 1000);
})();
