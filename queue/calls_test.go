package queue

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/shaper-dev/shaper/shaper"
)

func TestParseCalls(t *testing.T) {
	in := `{"id":"order-1","method":"POST","path":"/orders","headers":{"X-A":"b"},"body":{"n":1}}

{"path":"/orders/2"}
{"path":"/x","body":null}
{"path":"/y","callback":{"url":"https://hooks.example.com/shaper"}}
`
	calls, err := ParseCalls(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if len(calls) != 4 {
		t.Fatalf("%d calls, want 4", len(calls))
	}
	if cb := calls[3].Callback; cb == nil || cb.URL != "https://hooks.example.com/shaper" || calls[0].Callback != nil {
		t.Errorf("callbacks %+v and %+v", calls[3].Callback, calls[0].Callback)
	}
	if c := calls[0]; c.ID != "order-1" || c.Method != "POST" || c.Headers["X-A"] != "b" || string(c.Body) != `{"n":1}` {
		t.Errorf("call 1 = %+v", c)
	}
	if c := calls[1]; c.Method != "GET" || c.ID != "" {
		t.Errorf("call 2 = %+v, want GET without id", c)
	}
	if calls[2].Body != nil {
		t.Errorf("a null body should be no body")
	}
}

func TestParseCallsReportsEveryBadLine(t *testing.T) {
	in := `{"path":"/ok"}
{"path":"/../etc"}
[1,2]
{"id":"a","path":"/a"}
{"id":"a","path":"/b"}
{"method":"POST"}
{"path":"/x"} {"path":"/y"}
{"path":"/x","extra":1}
{"path":"/x","method":"delete"}
{"path":"/x","headers":{"Idempotency-Key":"k"}}
{"path":"/x","callback":"https://hooks.example.com"}
{"path":"/x","callback":{"url":"ftp://hooks.example.com"}}
{"path":"/x","callback":{"url":"https://hooks.example.com","secret":"x"}}
`
	_, err := ParseCalls(strings.NewReader(in))
	lines := badLines(t, err)
	want := []int{2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13}
	if len(lines) != len(want) {
		t.Fatalf("bad lines %v, want %v\n%v", lines, want, err)
	}
	for i := range want {
		if lines[i] != want[i] {
			t.Fatalf("bad lines %v, want %v\n%v", lines, want, err)
		}
	}
}

func FuzzParseCalls(f *testing.F) {
	f.Add(`{"id":"order-1042","method":"POST","path":"/orders","headers":{"X-A":"b"},"body":{"n":1}}`)
	f.Add(`{"path":"/a/../b"}`)
	f.Add("{\"path\":\"/x\"}\n\n{\"path\":\"//h\"}")
	f.Fuzz(func(t *testing.T, s string) {
		calls, err := ParseCalls(strings.NewReader(s))
		if err != nil {
			return
		}
		for _, c := range calls {
			if err := c.Validate(); err != nil {
				t.Errorf("accepted an invalid call %+v: %v", c, err)
			}
		}
	})
}

// TestParseCallsCostAndPriority reads costs and lanes, and reports every
// bad one with its line.
func TestParseCallsCostAndPriority(t *testing.T) {
	calls, err := ParseCalls(strings.NewReader(`{"path":"/a","cost":5,"priority":"high"}
{"path":"/b"}
`))
	if err != nil {
		t.Fatal(err)
	}
	if c := calls[0]; c.Cost != 5 || c.lane() != shaper.High {
		t.Errorf("call 1 = %+v, want cost 5 and the high lane", c)
	}
	if c := calls[1]; c.Cost != 0 || c.lane() != shaper.Normal {
		t.Errorf("call 2 = %+v, want the default cost and lane", c)
	}
	_, err = ParseCalls(strings.NewReader(`{"path":"/ok","cost":1}
{"path":"/a","cost":0}
{"path":"/a","cost":2.5}
{"path":"/a","cost":"5"}
{"path":"/a","cost":-3}
{"path":"/a","priority":"urgent"}
{"path":"/a","priority":""}
`))
	lines := badLines(t, err)
	if want := []int{2, 3, 4, 5, 6, 7}; !slices.Equal(lines, want) {
		t.Errorf("bad lines %v, want %v\n%v", lines, want, err)
	}
}

// badLines returns the line numbers of ParseCalls' joined *LineErrors.
func badLines(t *testing.T, err error) []int {
	t.Helper()
	joined, ok := err.(interface{ Unwrap() []error })
	if !ok {
		t.Fatalf("not joined line errors: %v", err)
	}
	var lines []int
	for _, e := range joined.Unwrap() {
		var le *LineError
		if !errors.As(e, &le) {
			t.Fatalf("not a line error: %v", e)
		}
		lines = append(lines, le.Line)
	}
	return lines
}
