package queue

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// LineError is one bad line of a call file.
type LineError struct {
	Line int
	Err  error
}

func (e *LineError) Error() string { return fmt.Sprintf("line %d: %v", e.Line, e.Err) }

// Unwrap returns the line's error.
func (e *LineError) Unwrap() error { return e.Err }

// maxCallLine bounds one line of a call file (its body included).
const maxCallLine = 4 << 20

// ParseCalls reads NDJSON call lines, one call each:
//
//	{"id":"order-1042","method":"POST","path":"/orders","headers":{"X-A":"b"},"body":{...}}
//	{"path":"/graphql","method":"POST","cost":5,"priority":"high","body":{...}}
//
// method defaults to GET; id is optional (it makes enqueueing idempotent);
// cost (units of every limit, default 1) and priority ("high" or
// "normal", the default) are optional.
// Blank lines are skipped. Every line is checked; all bad ones are
// returned (as *LineError, joined), so that nothing is enqueued from a
// file with a mistake in it.
func ParseCalls(r io.Reader) ([]Call, error) { return parseCalls(r, false) }

// ParseVendorCalls is ParseCalls for lines that each name their vendor
// ("vendor", required), as the HTTP API takes them:
//
//	{"vendor":"acme","id":"order-1042","method":"POST","path":"/orders","body":{...}}
func ParseVendorCalls(r io.Reader) ([]Call, error) { return parseCalls(r, true) }

func parseCalls(r io.Reader, withVendor bool) ([]Call, error) {
	var calls []Call
	err := ScanCalls(r, withVendor, func(c Call) error {
		calls = append(calls, c)
		return nil
	})
	return calls, err
}

// ScanCalls reads NDJSON call lines as ParseCalls does (with
// withVendor, as ParseVendorCalls does), handing each good call to fn as
// it is read, so that a file of any size is read in flat memory (but for
// the ids seen, to refuse a repeated one). It returns every bad line (as
// *LineError, joined), or fn's first error.
func ScanCalls(r io.Reader, withVendor bool, fn func(Call) error) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), maxCallLine)
	var errs []error
	seen := map[string]int{}
	line := 0
	for sc.Scan() {
		line++
		text := bytes.TrimSpace(sc.Bytes())
		if len(text) == 0 {
			continue
		}
		call, err := parseCallLine(text, withVendor)
		call.line = line
		if err == nil && call.ID != "" {
			if first, dup := seen[call.ID]; dup {
				err = fmt.Errorf("id %q is also on line %d; ids must be unique", call.ID, first)
			} else {
				seen[call.ID] = line
			}
		}
		if err != nil {
			errs = append(errs, &LineError{Line: line, Err: err})
			continue
		}
		if err := fn(call); err != nil {
			return err
		}
	}
	if err := sc.Err(); err != nil {
		if errors.Is(err, bufio.ErrTooLong) {
			err = fmt.Errorf("a line is longer than %d bytes", maxCallLine)
		}
		errs = append(errs, &LineError{Line: line + 1, Err: err})
	}
	return errors.Join(errs...)
}

func parseCallLine(text []byte, withVendor bool) (Call, error) {
	var j struct {
		Vendor   *string           `json:"vendor"`
		ID       *string           `json:"id"`
		Account  *string           `json:"account"`
		Method   *string           `json:"method"`
		Path     *string           `json:"path"`
		Headers  map[string]string `json:"headers"`
		Body     json.RawMessage   `json:"body"`
		Cost     json.RawMessage   `json:"cost"`
		Priority *string           `json:"priority"`
		Callback json.RawMessage   `json:"callback"`
		Next     *Next             `json:"next"`
		MaxPages *int              `json:"max_pages"`
	}
	dec := json.NewDecoder(bytes.NewReader(text))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&j); err != nil {
		msg := err.Error()
		if strings.HasPrefix(msg, "json: unknown field") {
			if withVendor {
				msg += " (a call has vendor, id, account, method, path, headers, body, cost, priority, callback, next and max_pages)"
			} else {
				msg += " (a call line has id, account, method, path, headers, body, cost, priority, callback, next and max_pages)"
			}
		}
		return Call{}, fmt.Errorf("not a call object: %s", msg)
	}
	switch {
	case withVendor && (j.Vendor == nil || *j.Vendor == ""):
		return Call{}, errors.New(`"vendor" is required: the [vendors.NAME] table the call goes to, e.g. "vendor":"acme"`)
	case !withVendor && j.Vendor != nil:
		return Call{}, errors.New(`"vendor" is not part of a call line: the vendor is --vendor's`)
	}
	if dec.More() {
		return Call{}, errors.New("more than one JSON value on the line")
	}
	if j.Path == nil {
		return Call{}, errors.New(`"path" is required, e.g. "path":"/orders"`)
	}
	c := Call{Path: *j.Path, Headers: j.Headers, Body: j.Body}
	if withVendor {
		c.Vendor = *j.Vendor
	}
	if j.ID != nil {
		c.ID = *j.ID
	}
	if j.Account != nil {
		c.Account = *j.Account
	}
	if j.Method != nil {
		c.Method = *j.Method
	}
	if j.Cost != nil {
		n, err := strconv.Atoi(string(j.Cost))
		if err != nil || n < 1 {
			return Call{}, fmt.Errorf(`"cost": %s: want a whole number of units, at least 1 (the default), e.g. "cost": 5`, j.Cost)
		}
		c.Cost = n
	}
	if j.Priority != nil {
		if *j.Priority == "" {
			return Call{}, errors.New(`"priority": "": want "high" or "normal" (the default)`)
		}
		c.Priority = *j.Priority
	}
	if j.Callback != nil && string(j.Callback) != "null" {
		cb, err := parseCallback(j.Callback)
		if err != nil {
			return Call{}, err
		}
		c.Callback = cb
	}
	c.Next = j.Next
	if j.MaxPages != nil {
		if *j.MaxPages < 1 {
			return Call{}, fmt.Errorf(`"max_pages": %d: want at least 1 (default %d)`, *j.MaxPages, DefaultMaxPages)
		}
		c.MaxPages = *j.MaxPages
	}
	if string(c.Body) == "null" {
		c.Body = nil
	}
	if err := c.Validate(); err != nil {
		return Call{}, err
	}
	return c, nil
}

// parseCallback reads a call line's "callback": {"url": "..."}.
func parseCallback(raw json.RawMessage) (*Callback, error) {
	var cb Callback
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&cb); err != nil || cb.URL == "" {
		return nil, fmt.Errorf(`"callback": %s: want {"url":"https://..."}, a URL under the config's [callbacks] allow`, raw)
	}
	return &cb, nil
}

// LineOf is the line of a call file (ParseCalls, ParseVendorCalls) a
// call came from; 0 for a call made otherwise.
func LineOf(c Call) int { return c.line }
