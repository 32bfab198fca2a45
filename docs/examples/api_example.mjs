// Queue calls through shaper's HTTP API, cancel one, follow another.
//
//   node api_example.mjs [BASE_URL [VENDOR]]
//
// BASE_URL defaults to $SHAPER_URL, else http://127.0.0.1:8081; VENDOR to
// $SHAPER_VENDOR, else acme. When the API needs a token, it is read from
// $SHAPER_API_TOKEN. Needs Node 18 or later (fetch is built in).
const base = (process.argv[2] ?? process.env.SHAPER_URL ?? "http://127.0.0.1:8081").replace(/\/+$/, "");
const vendor = process.argv[3] ?? process.env.SHAPER_VENDOR ?? "acme";
const auth = process.env.SHAPER_API_TOKEN ? { Authorization: `Bearer ${process.env.SHAPER_API_TOKEN}` } : {};
const api = (method, path, init = {}) => fetch(base + path, { ...init, method, headers: { ...auth, ...init.headers } });

// POST three calls as NDJSON, one per line. Their ids make the POST
// idempotent: the same lines posted again queue nothing twice.
const run = Date.now();
const calls = [1, 2, 3].map((n) => ({ vendor, id: `example-${run}-${n}`, method: "POST", path: "/orders", body: { n } }));
let r = await api("POST", "/v1/calls", {
  headers: { "Content-Type": "application/x-ndjson" },
  body: calls.map((c) => JSON.stringify(c) + "\n").join(""),
});
if (r.status === 429) {
  console.error(`the queue is full: try again in ${r.headers.get("Retry-After")} s`);
  process.exit(1);
}
if (r.status !== 202) {
  console.error(`POST refused: ${r.status} ${await r.text()}`); // {"error": ..., "lines": [{"line": 2, "error": ...}]}
  process.exit(1);
}
const { ids } = await r.json();
console.log(`queued ${ids.length} calls: ${ids.join(" ")}`);

// DELETE the last one: 200 if it had not started, 409 once it has.
r = await api("DELETE", `/v1/calls/${encodeURIComponent(ids.at(-1))}`);
const answer = await r.json();
console.log(r.status === 200 ? `cancelled ${ids.at(-1)} while ${answer.state}` : `not cancelled: ${r.status} ${answer.error}`);

// GET the first with ?wait=: the answer comes once it has ended (or after 30 s).
r = await api("GET", `/v1/calls/${encodeURIComponent(ids[0])}?wait=30s`);
if (!r.ok) {
  console.error(`GET: ${r.status} ${await r.text()}`);
  process.exit(1);
}
const call = await r.json();
console.log(`${ids[0]} ${call.state}, HTTP ${call.status}: ${call.reason}`);
process.exit(call.state === "completed" ? 0 : 1);
