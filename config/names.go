package config

// Names: what viper keeps intact, and suggestions for names it would
// mangle or keys that look like typos.

import (
	"regexp"
	"strings"
)

// vendorName is what viper keeps intact: it lower-cases keys and splits
// them on dots.
var vendorName = regexp.MustCompile(`^[a-z0-9_-]+$`)

func quoteKey(name string) string {
	if vendorName.MatchString(name) {
		return name
	}
	return `"` + name + `"`
}

// suggestName turns a name viper would mangle into one it keeps.
func suggestName(name string) string {
	s := strings.ToLower(name)
	s = regexp.MustCompile(`[^a-z0-9_-]+`).ReplaceAllString(s, "-")
	s = strings.Trim(s, "-")
	if s == "" {
		s = "vendor"
	}
	return s
}

// closest returns the known key within edit distance 2 of k, if any.
func closest(k string, known []string) string {
	best, bestD := "", 3
	for _, c := range known {
		if d := editDistance(k, c); d < bestD {
			best, bestD = c, d
		}
	}
	return best
}

func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur := make([]int, len(b)+1)
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev = cur
	}
	return prev[len(b)]
}
