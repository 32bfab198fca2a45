package config

// Locating keys in the config text, so that every error names its line.

import (
	"regexp"
	"strings"
)

// locate returns the 1-based line of key in [table], or of the table
// header when key is empty, or 0 when it cannot tell.
func locate(text, table, key string) int {
	lines := strings.Split(text, "\n")
	header := -1
	if table != "" && !strings.Contains(table, ".") && key == "" {
		// A top-level key or table.
		re := regexp.MustCompile(`^\s*(\[\s*` + regexp.QuoteMeta(table) + `\s*[\].]|` + regexp.QuoteMeta(table) + `\s*=)`)
		for i, l := range lines {
			if re.MatchString(l) {
				return i + 1
			}
		}
		return 0
	}
	parts := strings.SplitN(table, ".", 2)
	var re *regexp.Regexp
	if len(parts) == 2 {
		name := strings.Trim(parts[1], `"`)
		re = regexp.MustCompile(`^\s*\[\s*` + regexp.QuoteMeta(parts[0]) + `\s*\.\s*("` + regexp.QuoteMeta(name) + `"|'` + regexp.QuoteMeta(name) + `'|` + regexp.QuoteMeta(name) + `)\s*\]`)
	} else {
		re = regexp.MustCompile(`^\s*\[\s*` + regexp.QuoteMeta(table) + `\s*\]`)
	}
	for i, l := range lines {
		if re.MatchString(l) {
			header = i
			break
		}
	}
	if header < 0 {
		return 0
	}
	if key == "" {
		return header + 1
	}
	keyRe := regexp.MustCompile(`^\s*"?` + regexp.QuoteMeta(key) + `"?\s*=`)
	for i := header + 1; i < len(lines); i++ {
		if strings.HasPrefix(strings.TrimSpace(lines[i]), "[") {
			break
		}
		if keyRe.MatchString(lines[i]) {
			return i + 1
		}
	}
	return header + 1
}
