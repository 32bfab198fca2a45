package api

import (
	"bytes"
	"encoding/json"
	"fmt"
	"mime"
	"net/http"
	"net/http/httptest"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/shaper-dev/shaper/queue"
)

// openAPIDoc is the part of an OpenAPI document the tests read.
type openAPIDoc struct {
	OpenAPI string                                `json:"openapi"`
	Paths   map[string]map[string]json.RawMessage `json:"paths"` // path, method (or "parameters")
	Comps   struct {
		Schemas   map[string]*schema         `json:"schemas"`
		Responses map[string]json.RawMessage `json:"responses"`
	} `json:"components"`
}

type schema struct {
	Ref        string             `json:"$ref"`
	Type       string             `json:"type"`
	Format     string             `json:"format"`
	Required   []string           `json:"required"`
	Properties map[string]*schema `json:"properties"`
	Items      *schema            `json:"items"`
	Additional any                `json:"additionalProperties"`
}

type operation struct {
	Responses map[string]struct {
		Ref     string                     `json:"$ref"`
		Headers map[string]json.RawMessage `json:"headers"`
		Content map[string]json.RawMessage `json:"content"`
	} `json:"responses"`
}

var parsedDoc = sync.OnceValues(func() (*openAPIDoc, error) {
	var d openAPIDoc
	dec := json.NewDecoder(bytes.NewReader(openAPI))
	if err := dec.Decode(&d); err != nil {
		return nil, fmt.Errorf("openapi.json: %w", err)
	}
	return &d, nil
})

func loadDoc(t *testing.T) *openAPIDoc {
	t.Helper()
	d, err := parsedDoc()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// ops lists the document's operations as ServeMux patterns, "GET /v1/x".
func (d *openAPIDoc) ops() []string {
	var out []string
	for path, item := range d.Paths {
		for method := range item {
			if method != "parameters" {
				out = append(out, strings.ToUpper(method)+" "+path)
			}
		}
	}
	slices.Sort(out)
	return out
}

// op finds the operation that serves method and path (templates such as
// {id} match one segment), and its pattern.
func (d *openAPIDoc) op(method, path string) (string, *operation, error) {
	for tmpl, item := range d.Paths {
		re := "^" + regexp.MustCompile(`\\\{[^}]+\\\}`).ReplaceAllString(regexp.QuoteMeta(tmpl), `[^/]+`) + "$"
		if !regexp.MustCompile(re).MatchString(path) {
			continue
		}
		raw, ok := item[strings.ToLower(method)]
		if !ok {
			return "", nil, nil
		}
		var o operation
		if err := json.Unmarshal(raw, &o); err != nil {
			return "", nil, err
		}
		return method + " " + tmpl, &o, nil
	}
	return "", nil, nil
}

// resolve follows a schema's $ref.
func (d *openAPIDoc) resolve(s *schema) *schema {
	for s != nil && s.Ref != "" {
		s = d.Comps.Schemas[strings.TrimPrefix(s.Ref, "#/components/schemas/")]
	}
	return s
}

// checkedByOpenAPI wraps the API so that each of its answers in a test
// is checked against openapi.json: the route and method are documented,
// the status is among the operation's responses, the answer's media
// type is one the response documents (JSON, or NDJSON for results) and
// its headers (Retry-After, WWW-Authenticate, Location) are those
// documented. The answer passes through as it is written (a results
// stream is flushed as the handler flushes it); the checks run when the
// handler returns.
func checkedByOpenAPI(t *testing.T, h http.Handler) http.Handler {
	d := loadDoc(t)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec := &recorder{ResponseWriter: w}
		h.ServeHTTP(rec, r)
		if rec.code == 0 {
			rec.code = http.StatusOK
		}
		pattern, o, err := d.op(r.Method, r.URL.Path)
		switch {
		case err != nil:
			t.Errorf("openapi.json: %v", err)
			return
		case o == nil:
			t.Errorf("%s %s: answered %d, and openapi.json has no such operation", r.Method, r.URL.Path, rec.code)
			return
		}
		resp, ok := o.Responses[strconv.Itoa(rec.code)]
		if !ok {
			t.Errorf("%s answered %d %s; openapi.json documents %v", pattern, rec.code, rec.start.Bytes(), slices.Sorted(mapKeys(o.Responses)))
			return
		}
		if resp.Ref != "" {
			var shared struct {
				Headers map[string]json.RawMessage `json:"headers"`
				Content map[string]json.RawMessage `json:"content"`
			}
			_ = json.Unmarshal(d.Comps.Responses[strings.TrimPrefix(resp.Ref, "#/components/responses/")], &shared)
			resp.Headers, resp.Content = shared.Headers, shared.Content
		}
		ct, _, _ := mime.ParseMediaType(w.Header().Get("Content-Type"))
		if _, documented := resp.Content[ct]; !documented {
			t.Errorf("%s %d: Content-Type %q, documented %v", pattern, rec.code, ct, slices.Sorted(mapKeys(resp.Content)))
		}
		for name := range resp.Headers {
			if w.Header().Get(name) == "" {
				t.Errorf("%s %d: no %s header, which openapi.json documents", pattern, rec.code, name)
			}
		}
		for _, name := range []string{"Retry-After", "WWW-Authenticate", "Location"} {
			if _, documented := resp.Headers[name]; w.Header().Get(name) != "" && !documented {
				t.Errorf("%s %d: sends %s, which openapi.json does not document", pattern, rec.code, name)
			}
		}
	})
}

// recorder passes an answer through, keeping its status and its first
// bytes (for errors).
type recorder struct {
	http.ResponseWriter
	code  int
	start bytes.Buffer
}

func (r *recorder) WriteHeader(code int) {
	if r.code == 0 {
		r.code = code
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.code == 0 {
		r.code = http.StatusOK
	}
	if n := 512 - r.start.Len(); n > 0 {
		r.start.Write(p[:min(n, len(p))])
	}
	return r.ResponseWriter.Write(p)
}

// Unwrap lets http.ResponseController reach the server's writer (Flush,
// deadlines).
func (r *recorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

func mapKeys[M ~map[string]V, V any](m M) func(func(string) bool) {
	return func(yield func(string) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// TestOpenAPIRoutes: the document's operations are exactly the routes
// New registers; each is routed (answered in JSON by its handler, not
// the mux's 404 or 405), and a method the document does not list on a
// path is 405.
func TestOpenAPIRoutes(t *testing.T) {
	d := loadDoc(t)
	if !strings.HasPrefix(d.OpenAPI, "3.") {
		t.Errorf("openapi %q, want 3.x", d.OpenAPI)
	}
	var routed []string
	for _, r := range (&server{}).routes() {
		routed = append(routed, r.pattern)
	}
	slices.Sort(routed)
	if !slices.Equal(d.ops(), routed) {
		t.Fatalf("openapi.json documents %v; New routes %v", d.ops(), routed)
	}
	s := newSetup(t, Options{}, 10, false)
	bare := httptest.NewServer(New(Options{Client: s.client})) // not checkedByOpenAPI: it would refuse the 405s
	defer bare.Close()
	for path, item := range d.Paths {
		url := bare.URL + strings.ReplaceAll(path, "{id}", "no-such-call")
		for _, m := range []string{"GET", "POST", "PUT", "PATCH", "DELETE"} {
			_, documented := item[strings.ToLower(m)]
			req, err := http.NewRequest(m, url, nil)
			if err != nil {
				t.Fatal(err)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			json := strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json")
			switch {
			case documented && (!json || resp.StatusCode == http.StatusMethodNotAllowed):
				t.Errorf("%s %s: %d %s, want it routed to its handler (a JSON answer)", m, path, resp.StatusCode, resp.Header.Get("Content-Type"))
			case !documented && resp.StatusCode != http.StatusMethodNotAllowed:
				t.Errorf("%s %s: %d, want 405: openapi.json does not document it", m, path, resp.StatusCode)
			}
		}
	}
}

// TestOpenAPIServed: GET /v1/openapi.json serves the document, behind
// the token like every route; docs/openapi.json is the same file.
func TestOpenAPIServed(t *testing.T) {
	s := newSetup(t, Options{Token: "tok"}, 10, false)
	if a := do(t, "GET", s.url+"/v1/openapi.json", "", "", nil); a.status != http.StatusUnauthorized {
		t.Errorf("without the token: %d, want 401", a.status)
	}
	a := do(t, "GET", s.url+"/v1/openapi.json", "", "tok", nil)
	if a.status != http.StatusOK || !bytes.Equal(a.body, openAPI) {
		t.Errorf("GET /v1/openapi.json: %d, %d bytes; want 200 and the embedded document", a.status, len(a.body))
	}
	docs, err := os.ReadFile("../../docs/openapi.json")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(docs, openAPI) {
		t.Error("docs/openapi.json differs from internal/api/openapi.json: copy internal/api/openapi.json over it")
	}
}

// TestOpenAPISchemas: each answer's schema has exactly the JSON fields of
// its Go type, of the right JSON types, and requires exactly those that
// are always sent (no omitempty); the call schema has every field a call
// line takes.
func TestOpenAPISchemas(t *testing.T) {
	d := loadDoc(t)
	for name, v := range map[string]any{
		"Explanation": queue.Explanation{},
		"Accepted":    Accepted{},
		"Refusal":     Refusal{},
		"LineError":   lineError{},
		"Cancelled":   Cancelled{},
		// Exports.
		"Export":        ExportProgress{},
		"ExportStarted": ExportStarted{},
		"ResultLine":    queue.ResultLine{},
		"Answer":        queue.CallResult{},
		"ExportRetry":   queue.ExportRetry{},
		"ExportCancel":  queue.ExportCancel{},
		"Next":          queue.Next{},
	} {
		t.Run(name, func(t *testing.T) {
			s := d.Comps.Schemas[name]
			if s == nil {
				t.Fatalf("no schema %s", name)
			}
			fields := jsonFields(reflect.TypeOf(v))
			var names, required []string
			for _, f := range fields {
				names = append(names, f.name)
				if !f.omitempty {
					required = append(required, f.name)
				}
			}
			if got := slices.Sorted(mapKeys(s.Properties)); !slices.Equal(got, slices.Sorted(slices.Values(names))) {
				t.Errorf("schema properties %v; %T has %v", got, v, slices.Sorted(slices.Values(names)))
			}
			if got := slices.Sorted(slices.Values(s.Required)); !slices.Equal(got, slices.Sorted(slices.Values(required))) {
				t.Errorf("schema requires %v; %T always sends %v", got, v, slices.Sorted(slices.Values(required)))
			}
			for _, f := range fields {
				if p := d.resolve(s.Properties[f.name]); p != nil {
					checkType(t, d, name+"."+f.name, f.typ, p)
				}
			}
		})
	}
	t.Run("Call", func(t *testing.T) {
		s := d.Comps.Schemas["Call"]
		for _, f := range jsonFields(reflect.TypeOf(queue.Call{})) {
			switch f.name {
			case "export", "seq": // set by StartExport, not by a call line
				continue
			case "pull": // set by the worker on the pages it queues
				continue
			}
			p := d.resolve(s.Properties[f.name])
			if p == nil {
				t.Errorf("queue.Call has %q; the Call schema does not", f.name)
				continue
			}
			checkType(t, d, "Call."+f.name, f.typ, p)
		}
	})
}

// TestOpenAPICallFieldsAccepted: POST takes every property of the Call
// schema (none is refused as an unknown field), and refuses one it does
// not list, as additionalProperties: false says.
func TestOpenAPICallFieldsAccepted(t *testing.T) {
	d := loadDoc(t)
	s := newSetup(t, Options{}, 100, false)
	sample := map[string]any{
		"vendor": s.vendor, "path": "/a", "id": "fields-1", "account": "", "method": "POST", "headers": map[string]string{"X-A": "b"},
		"body": map[string]int{"n": 1}, "cost": 1, "priority": "high", "callback": map[string]string{"url": "https://hooks.example.com/x"},
		"next": map[string]string{"cursor": "/meta/next_cursor", "param": "cursor"}, "max_pages": 5,
	}
	props := d.Comps.Schemas["Call"].Properties
	if d.Comps.Schemas["Call"].Additional != false {
		t.Error("the Call schema allows additional properties; POST refuses them")
	}
	for name := range props {
		v, ok := sample[name]
		if !ok {
			t.Errorf("no sample value for the Call schema's %q: add one to this test", name)
			continue
		}
		call := map[string]any{"vendor": s.vendor, "path": "/a", name: v}
		b, _ := json.Marshal(call)
		if a := do(t, "POST", s.url+"/v1/calls", "application/json", "", b); bytes.Contains(a.body, []byte("unknown field")) {
			t.Errorf("POST a call with %q: %d %s: the schema documents it", name, a.status, a.body)
		}
	}
	a := do(t, "POST", s.url+"/v1/calls", "application/json", "", []byte(`{"vendor":"`+s.vendor+`","path":"/a","colour":"red"}`))
	if a.status != http.StatusBadRequest || !bytes.Contains(a.body, []byte("unknown field")) {
		t.Errorf("POST a call with a field the schema lacks: %d %s, want 400 naming it", a.status, a.body)
	}
}

type jsonField struct {
	name      string
	omitempty bool
	typ       reflect.Type
}

// jsonFields lists the fields encoding/json writes for t, embedded
// structs' flattened.
func jsonFields(t reflect.Type) []jsonField {
	var out []jsonField
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		if f.Anonymous && tag == "" {
			out = append(out, jsonFields(f.Type)...)
			continue
		}
		if !f.IsExported() || tag == "-" {
			continue
		}
		name, opts, _ := strings.Cut(tag, ",")
		if name == "" {
			name = f.Name
		}
		out = append(out, jsonField{name, strings.Contains(opts, "omitempty"), f.Type})
	}
	return out
}

// rawTypes are the Go types of the JSON a json.RawMessage field holds,
// where it always holds one: a results line's answer, and an explained
// call's, is a stored queue.CallResult.
var rawTypes = map[string]reflect.Type{
	"ResultLine.answer":  reflect.TypeOf(queue.CallResult{}),
	"Explanation.answer": reflect.TypeOf(queue.CallResult{}),
}

// checkType checks that schema p describes values of Go type typ.
func checkType(t *testing.T, d *openAPIDoc, where string, typ reflect.Type, p *schema) {
	t.Helper()
	if raw, ok := rawTypes[where]; ok && typ == reflect.TypeOf(json.RawMessage{}) {
		typ = raw
	}
	if typ == reflect.TypeOf(json.RawMessage{}) {
		if p.Type != "" {
			t.Errorf("%s: any JSON value, and the schema says %q", where, p.Type)
		}
		return
	}
	for typ.Kind() == reflect.Pointer {
		typ = typ.Elem()
	}
	want := map[reflect.Kind]string{reflect.String: "string", reflect.Int: "integer", reflect.Int64: "integer", reflect.Float64: "number",
		reflect.Bool: "boolean", reflect.Slice: "array", reflect.Map: "object", reflect.Struct: "object"}[typ.Kind()]
	if typ == reflect.TypeOf(time.Time{}) {
		want = "string"
		if p.Format != "date-time" {
			t.Errorf("%s: a time, and the schema's format is %q, not date-time", where, p.Format)
		}
	}
	if p.Type != want {
		t.Errorf("%s: a Go %s, and the schema's type is %q, not %q", where, typ, p.Type, want)
	}
	switch {
	case typ.Kind() == reflect.Slice && p.Items != nil:
		checkType(t, d, where+"[]", typ.Elem(), d.resolve(p.Items))
	case typ.Kind() == reflect.Struct && typ != reflect.TypeOf(time.Time{}):
		for _, f := range jsonFields(typ) {
			if q := d.resolve(p.Properties[f.name]); q == nil {
				t.Errorf("%s: %s has %q, the schema does not", where, typ, f.name)
			} else {
				checkType(t, d, where+"."+f.name, f.typ, q)
			}
		}
	}
}
