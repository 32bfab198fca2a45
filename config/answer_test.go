package config

import (
	"errors"
	"os"
	"reflect"
	"strings"
	"testing"

	"github.com/shaper-dev/shaper/queue"
)

// answerVendor is a vendor table on lines 1 to 3 followed by extra, on
// line 4 on; a vendor before it puts its lines further down.
func answerVendor(extra string) string {
	return "[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\n" + extra
}

func TestAnswerKeysDefaults(t *testing.T) {
	cfg, err := Parse("c.toml", []byte(answerVendor("")))
	if err != nil {
		t.Fatal(err)
	}
	v := cfg.Vendors[0]
	if v.MaxAnswer != 0 || v.KeepHeaders != nil {
		t.Errorf("max_answer %d, keep_headers %q: want 0 (queue's default) and nil", v.MaxAnswer, v.KeepHeaders)
	}
	if qv := v.Queue(); qv.MaxAnswer != 0 || qv.KeepHeaders != nil {
		t.Errorf("Queue(): MaxAnswer %d, KeepHeaders %q: want 0 and nil", qv.MaxAnswer, qv.KeepHeaders)
	}
}

func TestMaxAnswerForms(t *testing.T) {
	tests := []struct {
		value string // as written in the file
		want  int64
	}{
		{`512`, 512},
		{`"512"`, 512},
		{`"512B"`, 512},
		{`"64KiB"`, 64 << 10},
		{`"64 KiB"`, 64 << 10},
		{`"1MiB"`, 1 << 20},
		{`"16MiB"`, queue.MaxMaxAnswer},
		{`16777216`, queue.MaxMaxAnswer},
		{`"16384KiB"`, queue.MaxMaxAnswer},
		{`1`, 1},
		{`0`, queue.NoAnswerBody},
		{`"0"`, queue.NoAnswerBody},
		{`"0KiB"`, queue.NoAnswerBody},
	}
	for _, tt := range tests {
		t.Run(tt.value, func(t *testing.T) {
			cfg, err := Parse("c.toml", []byte(answerVendor("max_answer = "+tt.value+"\n")))
			if err != nil {
				t.Fatal(err)
			}
			v := cfg.Vendors[0]
			if v.MaxAnswer != tt.want {
				t.Errorf("max_answer = %s: MaxAnswer %d, want %d", tt.value, v.MaxAnswer, tt.want)
			}
			if got := v.Queue().MaxAnswer; got != tt.want {
				t.Errorf("max_answer = %s: Queue().MaxAnswer %d, want %d", tt.value, got, tt.want)
			}
		})
	}
}

func TestKeepHeaders(t *testing.T) {
	want := []string{"X-Request-Id", "Link", "X-RateLimit-Remaining", "etag"}
	cfg, err := Parse("c.toml", []byte(answerVendor(
		"keep_headers = [\"X-Request-Id\", \"Link\",\n  \"X-RateLimit-Remaining\", \"etag\"]\nmax_answer = 0\n")))
	if err != nil {
		t.Fatal(err)
	}
	v := cfg.Vendors[0]
	if !reflect.DeepEqual(v.KeepHeaders, want) {
		t.Errorf("KeepHeaders = %q, want %q (as written, in order)", v.KeepHeaders, want)
	}
	// Both reach the worker: what a start and a reload apply.
	wc, err := cfg.WorkerConfig()
	if err != nil {
		t.Fatal(err)
	}
	if qv := wc.Vendors[0]; !reflect.DeepEqual(qv.KeepHeaders, want) || qv.MaxAnswer != queue.NoAnswerBody {
		t.Errorf("worker's vendor: KeepHeaders %q, MaxAnswer %d; want %q and NoAnswerBody", qv.KeepHeaders, qv.MaxAnswer, want)
	}

	cfg, err = Parse("c.toml", []byte(answerVendor("keep_headers = []\n")))
	if err != nil {
		t.Fatal(err)
	}
	if got := cfg.Vendors[0].KeepHeaders; len(got) != 0 {
		t.Errorf("keep_headers = []: KeepHeaders %q, want none", got)
	}
}

func TestAnswerKeysErrors(t *testing.T) {
	// Another vendor first, so that the lines are not those of a file
	// with one vendor: the problem is on line 7 of [vendors.shop].
	const before = "[vendors.acme]\nbase_url = \"https://x\"\nrate = 1\n\n[vendors.shop]\nbase_url = \"https://y\"\n"
	const capHint = " is above the cap of 16MiB (16777216 bytes): every call a worker holds may hold its answer in memory; set at most \"16MiB\""
	const sizeHint = `want a whole number of bytes, alone or with B, KiB or MiB, e.g. "512", "64KiB" or "1MiB"`
	const unitHint = `: want B, KiB (1024 bytes) or MiB (1024 KiB), written so (KB and MB are not taken: 1000 or 1024 bytes?)`
	const nameHint = `: want a header name: a quoted, non-empty token without spaces, colons or control characters, e.g. "X-Request-Id"`
	const ma = "c.toml:7: invalid config: vendors.shop.max_answer: "
	const kh = "c.toml:7: invalid config: vendors.shop.keep_headers: "
	tests := []struct {
		name string
		line string // line 7
		want string // the whole error
	}{
		{"above the cap", "max_answer = 16777217", ma + "16777217" + capHint},
		{"above the cap with a unit", `max_answer = "17MiB"`, ma + `"17MiB"` + capHint},
		{"above the cap in KiB", `max_answer = "16385KiB"`, ma + `"16385KiB"` + capHint},
		{"beyond an int64", `max_answer = "99999999999999999999MiB"`, ma + `"99999999999999999999MiB"` + capHint},
		{"negative", "max_answer = -1", ma + "-1 must not be negative; 0 keeps no body (the status and keep_headers only)"},
		{"negative with a unit", `max_answer = "-1KiB"`, ma + `"-1KiB" must not be negative; 0 keeps no body (the status and keep_headers only)`},
		{"KB", `max_answer = "64KB"`, ma + `"64KB": unit "KB"` + unitHint},
		{"MB", `max_answer = "1MB"`, ma + `"1MB": unit "MB"` + unitHint},
		{"lower-case unit", `max_answer = "1mib"`, ma + `"1mib": unit "mib"` + unitHint},
		{"GiB", `max_answer = "1GiB"`, ma + `"1GiB": unit "GiB"` + unitHint},
		{"a fraction", `max_answer = "1.5MiB"`, ma + `"1.5MiB": ` + sizeHint},
		{"no number", `max_answer = "MiB"`, ma + `"MiB": ` + sizeHint},
		{"empty string", `max_answer = ""`, ma + `"": ` + sizeHint},
		{"a float", "max_answer = 1.5", ma + `1.5: want a whole number of bytes or a size such as "64KiB" or "1MiB"`},
		{"a boolean", "max_answer = true", ma + `true: want a whole number of bytes or a size such as "64KiB" or "1MiB"`},
		{"a space in a header name", `keep_headers = ["X Request-Id"]`, kh + `item 1 = "X Request-Id"` + nameHint},
		{"a colon in a header name", `keep_headers = ["Link", "X-Request-Id:"]`, kh + `item 2 = "X-Request-Id:"` + nameHint},
		{"an empty header name", `keep_headers = [""]`, kh + `item 1 = ""` + nameHint},
		{"a header name with a newline", `keep_headers = ["X-A\nX-B"]`, kh + `item 1 = "X-A\nX-B"` + nameHint},
		{"a number for a header name", `keep_headers = [42]`, kh + `item 1 = 42` + nameHint},
		{"a header listed twice", `keep_headers = ["Link", "link"]`, kh + `item 2 = "link": already item 1 (header names are case-insensitive); list it once`},
		{"not an array", `keep_headers = "Link"`, kh + `"Link": want an array of header names, e.g. keep_headers = ["X-Request-Id", "Link"]`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse("c.toml", []byte(before+tt.line+"\nrate = 1\n"))
			if err == nil {
				t.Fatal("accepted")
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("error does not wrap ErrInvalid: %v", err)
			}
			if err.Error() != tt.want {
				t.Errorf("error\n%s\nwant\n%s", err, tt.want)
			}
		})
	}
}

// TestAnswerKeysNotPerAccount checks that the keys are the vendor's
// only: an account_overrides item that sets one is refused, naming the
// item, its account and its line.
func TestAnswerKeysNotPerAccount(t *testing.T) {
	text := "[vendors.shop]\nbase_url = \"https://api.shop.example/stores/{account}\"\nper_account = true\nrate = 2\n" +
		"max_answer = \"64KiB\"\n" +
		"account_overrides = [\n  { account = \"a\", rate = 3 },\n  { account = \"big-store\", max_answer = \"1MiB\", keep_headers = [\"Link\"] },\n]\n"
	_, err := Parse("c.toml", []byte(text))
	if err == nil {
		t.Fatal("accepted max_answer and keep_headers in an override")
	}
	for _, key := range []string{"keep_headers", "max_answer"} {
		want := `c.toml:8: invalid config: vendors.shop.account_overrides item 2 (account "big-store"): unknown key "` + key + `"`
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error\n%s\ndoes not say\n%s", err, want)
		}
	}
}

// TestExampleAnswerKeys checks that the example config's commented
// max_answer and keep_headers lines are valid once uncommented.
func TestExampleAnswerKeys(t *testing.T) {
	data, err := os.ReadFile("../config.toml")
	if err != nil {
		t.Fatal(err)
	}
	text := string(data)
	for _, key := range []string{"max_answer", "keep_headers"} {
		if n := strings.Count(text, "\n# "+key+" = "); n != 1 {
			t.Fatalf("config.toml has %d commented %s lines, want 1", n, key)
		}
		text = strings.Replace(text, "\n# "+key+" = ", "\n"+key+" = ", 1)
	}
	cfg, err := Parse("config.toml", []byte(text))
	if err != nil {
		t.Fatalf("the example's max_answer and keep_headers, uncommented: %v", err)
	}
	acme, _ := cfg.Vendor("acme")
	if acme.MaxAnswer != queue.DefaultMaxAnswer || len(acme.KeepHeaders) == 0 {
		t.Errorf("acme: MaxAnswer %d, KeepHeaders %q: want the default, 1MiB, said out loud, and some headers", acme.MaxAnswer, acme.KeepHeaders)
	}
}

// FuzzMaxAnswer checks that no max_answer value is accepted outside
// what a worker can keep: none, or 1 byte to queue.MaxMaxAnswer.
func FuzzMaxAnswer(f *testing.F) {
	for _, s := range []string{`512`, `"64KiB"`, `"1 MiB"`, `0`, `-1`, `"16MiB"`, `"16385KiB"`, `"9223372036854775807"`,
		`"-9223372036854775808MiB"`, `"99999999999999999999B"`, `1.5`, `"1MB"`, `[1]`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, value string) {
		cfg, err := Parse("fuzz.toml", []byte(answerVendor("max_answer = "+value+"\n")))
		if err != nil {
			return
		}
		for _, v := range cfg.Vendors {
			if n := v.MaxAnswer; n != 0 && n != queue.NoAnswerBody && (n < 1 || n > queue.MaxMaxAnswer) {
				t.Errorf("max_answer = %s accepted as %d bytes", value, n)
			}
		}
	})
}
