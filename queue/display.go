package queue

import (
	"encoding/json"
	"fmt"
	"strings"
)

// DescribePayload says what a task is without what it carries: for a
// call, its method and path (without the query, which may hold a key),
// account, lane and cost, and how many headers and body bytes it has;
// for a task of the user's own type, its payload's size. Task views
// (asynqmon under the live page) show it in place of the payload.
func DescribePayload(taskType string, payload []byte) string {
	if taskType != TypeCall {
		return fmt.Sprintf("%s: %d-byte payload (not shown)", taskType, len(payload))
	}
	var c Call
	if err := json.Unmarshal(payload, &c); err != nil {
		return fmt.Sprintf("call: unreadable payload (%d bytes)", len(payload))
	}
	method := c.Method
	if method == "" {
		method = "GET"
	}
	path, query, _ := strings.Cut(c.Path, "?")
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s %s", c.Vendor, method, path)
	if query != "" {
		b.WriteString("?… (query not shown)")
	}
	if c.Account != "" {
		fmt.Fprintf(&b, ", account %s", c.Account)
	}
	if c.Priority == "high" {
		b.WriteString(", high lane")
	}
	if c.Cost > 1 {
		fmt.Fprintf(&b, ", cost %d", c.Cost)
	}
	if n := len(c.Headers); n > 0 {
		fmt.Fprintf(&b, ", %d header(s) (values not shown)", n)
	}
	if n := len(c.Body); n > 0 {
		fmt.Fprintf(&b, ", %d-byte body (not shown)", n)
	}
	return b.String()
}

// DescribeResult says how a task ended without its body: a call's HTTP
// status; for a task of the user's own type, its result's size.
func DescribeResult(taskType string, result []byte) string {
	if len(result) == 0 {
		return ""
	}
	if taskType != TypeCall {
		return fmt.Sprintf("%d-byte result (not shown)", len(result))
	}
	var r CallResult
	if err := json.Unmarshal(result, &r); err != nil || r.Status == 0 {
		return fmt.Sprintf("%d-byte result (not shown)", len(result))
	}
	return fmt.Sprintf("HTTP %d (body not shown)", r.Status)
}
