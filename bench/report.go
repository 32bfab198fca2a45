package main

import (
	"fmt"
	"strings"
	"time"
)

// table renders the results as a markdown table.
func table(results []Result) string {
	var b strings.Builder
	b.WriteString("| approach | limit/s | replicas | calls done | HTTP 429s | most calls in a vendor window / limit | utilisation | wait p50 | wait p99 | completion |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range results {
		fmt.Fprintf(&b, "| %s | %d | %d | %d/%d | %d | %d / %d | %.0f%% | %s | %s | %s |\n",
			r.Approach, r.Rate, r.Replicas, r.Done, r.Calls, r.RateLimited, r.MaxWindow, r.Rate,
			100*r.Utilisation, r.P50.Round(10*time.Millisecond), r.P99.Round(10*time.Millisecond), tookString(r.Took))
	}
	return b.String()
}

// chart draws calls per vendor window over time, one line per approach,
// for the runs at the given rate and replica count, with the limit as a
// dashed line.
func chart(results []Result, rate, replicas int) string {
	const w, h, left, bottom, top, right = 960, 420, 60, 50, 30, 350
	var runs []Result
	maxY, maxX := rate, 1
	for _, r := range results {
		if r.Rate == rate && r.Replicas == replicas {
			runs = append(runs, r)
			for _, c := range r.PerWindow {
				maxY = max(maxY, c)
			}
			maxX = max(maxX, len(r.PerWindow))
		}
	}
	x := func(i int) float64 { return left + float64(i)*float64(w-left-right)/float64(max(maxX-1, 1)) }
	y := func(v int) float64 { return float64(h-bottom) - float64(v)*float64(h-bottom-top)/float64(maxY) }
	colors := []string{"#1b7837", "#d73027", "#fc8d59", "#91bfdb", "#4575b4", "#984ea3"}
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", w, h)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", w, h)
	fmt.Fprintf(&b, `<text x="%d" y="18" font-size="14">Calls per vendor window (limit %d per second, %d replicas)</text>`+"\n", left, rate, replicas)
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", left, h-bottom, w-right, h-bottom)
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", left, top, left, h-bottom)
	for _, v := range []int{0, maxY / 2, maxY} {
		fmt.Fprintf(&b, `<text x="%d" y="%.0f" text-anchor="end">%d</text>`+"\n", left-6, y(v)+4, v)
	}
	fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle">vendor window (seconds since start)</text>`+"\n", (left+w-right)/2, h-12)
	for i := 0; i < maxX; i += max(1, maxX/10) {
		fmt.Fprintf(&b, `<text x="%.0f" y="%d" text-anchor="middle">%d</text>`+"\n", x(i), h-bottom+16, i)
	}
	fmt.Fprintf(&b, `<line x1="%d" y1="%.0f" x2="%d" y2="%.0f" stroke="black" stroke-dasharray="6,4"/>`+"\n", left, y(rate), w-right, y(rate))
	fmt.Fprintf(&b, `<text x="%d" y="%.0f">limit</text>`+"\n", w-right+4, y(rate)+4)
	for i, r := range runs {
		var pts []string
		for k, c := range r.PerWindow {
			pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(k), y(c)))
		}
		col := colors[i%len(colors)]
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", col, strings.Join(pts, " "))
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="12" height="12" fill="%s"/><text x="%d" y="%d">%s</text>`+"\n",
			w-right+20, top+30+i*20, col, w-right+36, top+41+i*20, r.Approach)
	}
	b.WriteString("</svg>\n")
	return b.String()
}
