#!/usr/bin/env bash
# Queue calls through shaper's HTTP API with curl, cancel one, follow another.
#
#     bash api_example.sh [BASE_URL [VENDOR]]
#
# BASE_URL defaults to $SHAPER_URL, else http://127.0.0.1:8081; VENDOR to
# $SHAPER_VENDOR, else acme. When the API needs a token, it is read from
# $SHAPER_API_TOKEN. Needs curl; reads the answers with sed (no jq).
set -euo pipefail
base=${1:-${SHAPER_URL:-http://127.0.0.1:8081}}
vendor=${2:-${SHAPER_VENDOR:-acme}}
api() { # curl with the token, if any; prints the body, then the status on a line of its own
  if [ -n "${SHAPER_API_TOKEN:-}" ]; then set -- -H "Authorization: Bearer $SHAPER_API_TOKEN" "$@"; fi
  curl -sS -w '\n%{http_code}' "$@"
}
field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^\",}]*\).*/\1/p"; } # one field of a one-line JSON answer

# POST three calls as NDJSON, one per line. Their ids make the POST
# idempotent: the same lines posted again queue nothing twice.
run=example-$(date +%s)$$
out=$(for n in 1 2 3; do
  printf '{"vendor":"%s","id":"%s-%d","method":"POST","path":"/orders","body":{"n":%d}}\n' "$vendor" "$run" "$n" "$n"
done | api -H 'Content-Type: application/x-ndjson' --data-binary @- "$base/v1/calls")
code=${out##*$'\n'} body=${out%$'\n'*}
if [ "$code" = 429 ]; then echo "the queue is full: try again later" >&2; exit 1; fi
if [ "$code" != 202 ]; then echo "POST refused: $code $body" >&2; exit 1; fi # {"error": ..., "lines": [...]}
ids=$(printf '%s' "$body" | sed 's/.*"ids":\[\([^]]*\)\].*/\1/' | tr -d '"' | tr ',' ' ')
echo "queued 3 calls: $ids"

# DELETE the last one: 200 if it had not started, 409 once it has.
out=$(api -X DELETE "$base/v1/calls/$run-3")
code=${out##*$'\n'} body=${out%$'\n'*}
if [ "$code" = 200 ]; then
  echo "cancelled $run-3 while $(printf '%s' "$body" | field state)"
else
  echo "not cancelled: $code $(printf '%s' "$body" | field error)"
fi

# GET the first with ?wait=: the answer comes once it has ended (or after 30 s).
out=$(api "$base/v1/calls/$run-1?wait=30s")
code=${out##*$'\n'} body=${out%$'\n'*}
if [ "$code" != 200 ]; then echo "GET: $code $body" >&2; exit 1; fi
state=$(printf '%s' "$body" | field state)
echo "$run-1 $state, HTTP $(printf '%s' "$body" | field status): $(printf '%s' "$body" | field reason)"
[ "$state" = completed ]
