package queue

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestDescribe: what task views show of a call names its method and path
// and never a header value, the query or the body; a result shows the
// status, not the body excerpt.
func TestDescribe(t *testing.T) {
	call := Call{Vendor: "acme", Account: "store-1", Method: "POST", Path: "/orders?api_key=SECRETKEY",
		Headers: map[string]string{"Authorization": "Bearer SECRETTOKEN"}, Body: json.RawMessage(`{"card":"SECRETCARD"}`),
		Priority: "high", Cost: 3}
	payload, err := json.Marshal(call)
	if err != nil {
		t.Fatal(err)
	}
	got := DescribePayload(TypeCall, payload)
	want := "acme POST /orders?… (query not shown), account store-1, high lane, cost 3, 1 header(s) (values not shown), 21-byte body (not shown)"
	if got != want {
		t.Errorf("DescribePayload = %q\nwant %q", got, want)
	}
	res, _ := json.Marshal(CallResult{Status: 201, Excerpt: `{"id":"SECRETID"}`})
	if got := DescribeResult(TypeCall, res); got != "HTTP 201 (body not shown)" {
		t.Errorf("DescribeResult = %q", got)
	}
	for _, s := range []string{DescribePayload(TypeCall, payload), DescribeResult(TypeCall, res),
		DescribePayload("user:export", []byte("SECRETUSER")), DescribeResult("user:export", []byte("SECRETUSER")),
		DescribePayload(TypeCall, []byte("{SECRETBROKEN"))} {
		if strings.Contains(s, "SECRET") {
			t.Errorf("%q shows a secret", s)
		}
	}
	if got := DescribePayload(TypeCall, []byte(`{"vendor":"v","path":"/x"}`)); got != "v GET /x" {
		t.Errorf("default method: %q", got)
	}
}
