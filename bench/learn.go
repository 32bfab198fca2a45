package main

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// learnDoc copies the rows that the learning scenarios logged (lines
// "sim-report: | ... |" and "learn-report: | ... |" in go test -v
// output read from in) into docs/learning.md, between its markers.
func learnDoc(in, outDir, command string) error {
	f, err := os.Open(in)
	if err != nil {
		return err
	}
	defer f.Close()
	var sim, real []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if _, row, ok := strings.Cut(line, "sim-report: "); ok {
			sim = append(sim, strings.TrimSpace(row))
		} else if _, row, ok := strings.Cut(line, "learn-report: "); ok {
			real = append(real, strings.TrimSpace(row))
		}
	}
	if err := sc.Err(); err != nil {
		return err
	}
	if len(sim) == 0 || len(real) == 0 {
		return fmt.Errorf("%s holds %d simulator rows and %d wall-clock rows: run the learning scenarios with -v into it (make bench-learn)", in, len(sim), len(real))
	}
	day := time.Now().UTC().Format("2006-01-02")
	simTable := fmt.Sprintf("Run on %s:\n\n| vendor | share of the limit | bar | 429s | per 1,000 | rate at the end | guard |\n|---|---|---|---|---|---|---|\n%s\n",
		day, strings.Join(sim, "\n"))
	realTable := fmt.Sprintf("`%s`, on %s (this machine: 2 vCPU, Redis on loopback; a busy machine moves these by several points):\n\n| scenario | share of the limit | 429s | per 1,000 |\n|---|---|---|---|\n%s\n",
		command, day, strings.Join(real, "\n"))
	path := filepath.Join(outDir, "learning.md")
	doc, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	out, err := splice(string(doc), "simulator", simTable)
	if err != nil {
		return err
	}
	if out, err = splice(out, "bench-learn", realTable); err != nil {
		return err
	}
	return os.WriteFile(path, []byte(out), 0o644)
}

// splice replaces what lies between <!-- name:start --> and
// <!-- name:end --> in doc with body.
func splice(doc, name, body string) (string, error) {
	start, end := "<!-- "+name+":start -->", "<!-- "+name+":end -->"
	i, j := strings.Index(doc, start), strings.Index(doc, end)
	if i < 0 || j < i {
		return "", fmt.Errorf("docs/learning.md lacks the markers %s and %s", start, end)
	}
	return doc[:i+len(start)] + "\n" + body + doc[j:], nil
}
