package api

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"testing"
)

// examples are docs/examples' programs, each with its interpreter, the
// check that it can run here, and what to install when it cannot.
var examples = []struct {
	file    string
	command []string
	check   []string
	install string
}{
	{"api_example.py", []string{"python3"}, []string{"python3", "-c", "import requests"},
		"python3 and requests (Debian: apt-get install python3 python3-requests; else pip install requests)"},
	{"api_example.sh", []string{"bash"}, []string{"curl", "--version"}, "curl (Debian: apt-get install curl)"},
	{"api_example.mjs", []string{"node"}, []string{"node", "-e", "process.exit(typeof fetch === 'function' ? 0 : 1)"},
		"Node.js 18 or later, which has fetch (Debian 12+: apt-get install nodejs)"},
}

// TestExamplesInDocs: docs/api.md shows each example program verbatim,
// in the code block after the line that links it.
func TestExamplesInDocs(t *testing.T) {
	doc, err := os.ReadFile("../../docs/api.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, ex := range examples {
		file, err := os.ReadFile(filepath.Join("..", "..", "docs", "examples", ex.file))
		if err != nil {
			t.Fatal(err)
		}
		re := regexp.MustCompile("\\]\\(examples/" + regexp.QuoteMeta(ex.file) + "\\)[^\n]*\n\n```[a-z]*\n((?s:.*?))```\n")
		m := re.FindSubmatch(doc)
		if m == nil {
			t.Errorf("docs/api.md has no code block after a link to examples/%s", ex.file)
			continue
		}
		if !bytes.Equal(m[1], file) {
			t.Errorf("docs/api.md's copy of examples/%s differs from the file: paste the file into it", ex.file)
		}
	}
}
