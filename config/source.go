package config

// Locating keys in the config text, so that every error names its line.

import (
	"regexp"
	"slices"
	"strings"
)

// locate returns the 1-based line of key in [table], or of the table
// header when key is empty, or 0 when it cannot tell. table is a dotted
// key whose parts may be quoted (vendors."api.example.com"); a sub-table
// written in its parent (total = { ... } or total.rate = 1 in
// [vendors.shop]) is found at its key there.
func locate(text, table, key string) int {
	lines := strings.Split(text, "\n")
	parts := splitKey(table)
	if len(parts) == 1 && key == "" {
		// A top-level key or table.
		re := regexp.MustCompile(`^\s*(\[\s*` + regexp.QuoteMeta(table) + `\s*[\].]|` + regexp.QuoteMeta(table) + `\s*=)`)
		for i, l := range lines {
			if re.MatchString(l) {
				return i + 1
			}
		}
		return 0
	}
	header := findLine(lines, 0, len(lines), tableHeader(parts, false))
	if header < 0 {
		if len(parts) > 2 {
			return locate(text, strings.Join(parts[:len(parts)-1], "."), parts[len(parts)-1])
		}
		return 0
	}
	if key == "" {
		return header + 1
	}
	end := header + 1
	for end < len(lines) && !strings.HasPrefix(strings.TrimSpace(lines[end]), "[") {
		end++
	}
	if i := findLine(lines, header+1, end, regexp.MustCompile(`^\s*`+keyPattern(key)+`\s*[=.]`)); i >= 0 {
		return i + 1
	}
	return header + 1
}

// locateItem returns the 1-based line of item n (from 1) of the array of
// tables key in [table]: where its { opens when the array is written
// inline, its [[table.key]] header otherwise; or the key's line when it
// cannot tell.
func locateItem(text, table, key string, n int) int {
	lines := strings.Split(text, "\n")
	parts := splitKey(table)
	header := findLine(lines, 0, len(lines), tableHeader(parts, false))
	if header < 0 {
		return locate(text, table, key)
	}
	// The table's section, its sub-tables included.
	sub := regexp.MustCompile(`^\s*\[\[?\s*` + partsPattern(parts) + `\s*\.`)
	end := header + 1
	for end < len(lines) && (!strings.HasPrefix(strings.TrimSpace(lines[end]), "[") || sub.MatchString(lines[end])) {
		end++
	}
	arrayHeader := tableHeader(slices.Concat(parts, []string{key}), true)
	for i, k := header+1, n; i < end; i++ {
		if arrayHeader.MatchString(lines[i]) {
			if k--; k == 0 {
				return i + 1
			}
		}
	}
	keyLine := findLine(lines, header+1, end, regexp.MustCompile(`^\s*`+keyPattern(key)+`\s*=`))
	if keyLine < 0 {
		return header + 1
	}
	if i := inlineItem(lines[keyLine:], n); i >= 0 {
		return keyLine + i + 1
	}
	return keyLine + 1
}

// inlineItem returns the index in lines of the line where the inline
// table of item n opens, in the array that starts after the first '=' of
// lines[0]; or -1. It skips strings and comments.
func inlineItem(lines []string, n int) int {
	depth := 0
	for i, l := range lines {
		if i == 0 {
			_, l, _ = strings.Cut(l, "=")
		}
		for j := 0; j < len(l); j++ {
			switch c := l[j]; c {
			case '#':
				j = len(l)
			case '"', '\'':
				// A string on one line: find its closing quote.
				for j++; j < len(l) && l[j] != c; j++ {
					if c == '"' && l[j] == '\\' {
						j++
					}
				}
			case '[', '{':
				depth++
				if c == '{' && depth == 2 {
					if n--; n == 0 {
						return i
					}
				}
			case ']', '}':
				if depth--; depth == 0 {
					return -1
				}
			}
		}
	}
	return -1
}

// findLine returns the index of the first of lines[from:to] that re
// matches, or -1.
func findLine(lines []string, from, to int, re *regexp.Regexp) int {
	for i := from; i < to; i++ {
		if re.MatchString(lines[i]) {
			return i
		}
	}
	return -1
}

// tableHeader matches the header of the table named by parts: [a.b], or
// [[a.b]] when array is set.
func tableHeader(parts []string, array bool) *regexp.Regexp {
	open, closing := `\[`, `\]`
	if array {
		open, closing = `\[\[`, `\]\]`
	}
	return regexp.MustCompile(`^\s*` + open + `\s*` + partsPattern(parts) + `\s*` + closing)
}

// partsPattern matches the dotted key of parts, each bare or quoted.
func partsPattern(parts []string) string {
	pats := make([]string, len(parts))
	for i, p := range parts {
		pats[i] = keyPattern(p)
	}
	return strings.Join(pats, `\s*\.\s*`)
}

func keyPattern(k string) string {
	q := regexp.QuoteMeta(k)
	return `(?:"` + q + `"|'` + q + `'|` + q + `)`
}

// splitKey splits a dotted key on the dots outside quotes and unquotes
// its parts: vendors."api.example.com" is vendors and api.example.com.
func splitKey(key string) []string {
	var parts []string
	var cur strings.Builder
	var quote rune
	for _, r := range key {
		switch {
		case quote != 0 && r == quote:
			quote = 0
		case quote != 0:
			cur.WriteRune(r)
		case r == '"' || r == '\'':
			quote = r
		case r == '.':
			parts = append(parts, strings.TrimSpace(cur.String()))
			cur.Reset()
		default:
			cur.WriteRune(r)
		}
	}
	return append(parts, strings.TrimSpace(cur.String()))
}
