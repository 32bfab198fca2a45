// Package metrics serves a worker's Prometheus metrics and health check:
// calls started and rate-limited answers, wait for a tick, queue depth, effective
// rate and pauses, per vendor; and the Prometheus client's standard Go
// runtime (go_*) and process (process_*) metrics.
package metrics

import (
	"context"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
)

// Metrics records call events (it is a vendorclients.Observer) and reads
// the rest from Redis when scraped.
type Metrics struct {
	started     *prometheus.CounterVec
	rateLimited *prometheus.CounterVec
	wait        *prometheus.HistogramVec
	reg         *prometheus.Registry
}

// New returns metrics for a worker; buckets and client give the
// scrape-time gauges.
func New(worker Worker, client *queue.Client) *Metrics {
	m := &Metrics{
		started: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shaper_calls_started_total", Help: "Calls this worker started at their tick.",
		}, []string{"vendor"}),
		rateLimited: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shaper_rate_limited_total", Help: "Rate-limited answers (429, or 503 with Retry-After) seen by this worker.",
		}, []string{"vendor"}),
		wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "shaper_tick_wait_seconds", Help: "Time a call waited for its release tick.",
			Buckets: []float64{.001, .005, .01, .05, .1, .25, .5, 1, 2.5, 5},
		}, []string{"vendor"}),
		reg: prometheus.NewRegistry(),
	}
	m.reg.MustRegister(m.started, m.rateLimited, m.wait, &collector{worker: worker, client: client},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Started implements vendorclients.Observer.
func (m *Metrics) Started(vendor string, wait time.Duration) {
	m.started.WithLabelValues(vendor).Inc()
	m.wait.WithLabelValues(vendor).Observe(wait.Seconds())
}

// RateLimited implements vendorclients.Observer.
func (m *Metrics) RateLimited(vendor string) { m.rateLimited.WithLabelValues(vendor).Inc() }

// Handler serves /metrics, and /healthz which fails when Redis is
// unreachable.
func (m *Metrics) Handler(rdb redis.UniversalClient) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := rdb.Ping(ctx).Err(); err != nil {
			http.Error(w, "redis unreachable: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.Write([]byte("ok\n"))
	})
	return mux
}

var (
	queueDepth      = prometheus.NewDesc("shaper_queue_depth", "Calls in the vendor's queue, by state.", []string{"vendor", "state"}, nil)
	effectiveRate   = prometheus.NewDesc("shaper_effective_rate", "Calls per second the gate grants now (below the configured rate after adaptation).", []string{"vendor"}, nil)
	configRate      = prometheus.NewDesc("shaper_configured_rate", "Calls per second the config allows, after burst and guard.", []string{"vendor"}, nil)
	rateSource      = prometheus.NewDesc("shaper_rate_source", "1 for what sets the effective rate now: configured, announced (rate-limit headers), learned (429s), set, margin (a guard learned from 429s at the full spacing) or warmup.", []string{"vendor", "source"}, nil)
	guard           = prometheus.NewDesc("shaper_guard_seconds", "The guard in force: the configured one, or a wider one learned from 429s at the full spacing.", []string{"vendor"}, nil)
	paused          = prometheus.NewDesc("shaper_paused", "1 while the vendor is paused (429, Retry-After).", []string{"vendor"}, nil)
	pauseLeft       = prometheus.NewDesc("shaper_pause_remaining_seconds", "Time until the vendor's pause ends.", []string{"vendor"}, nil)
	accountsBacklog = prometheus.NewDesc("shaper_accounts_with_backlog", "Accounts of a per-account vendor with calls planned ahead (no per-account label: accounts are unbounded).", []string{"vendor"}, nil)
	served          = prometheus.NewDesc("shaper_vendors_served", "Vendors this worker runs a server for now: those whose queues hold work (an idle vendor costs nothing).", nil, nil)
	oldest          = prometheus.NewDesc("shaper_oldest_queued_seconds", "Age of the oldest call waiting in the vendor's queue.", []string{"vendor"}, nil)
	stalled         = prometheus.NewDesc("shaper_stalled_calls", "Calls held by a worker that has not renewed their lease for over 10 s (it died, or lost Redis): asynq gives them back once the lease is 30 s past due.", []string{"vendor"}, nil)
	stalledFor      = prometheus.NewDesc("shaper_stalled_seconds", "The longest time since a stalled call's lease was renewed (0: none stalled).", []string{"vendor"}, nil)
)

// Worker is what the metrics read of a running worker (a *queue.Worker).
type Worker interface {
	Buckets() map[string]*shaper.Bucket
	Serving() int
	AccountBacklogs(ctx context.Context) (map[string]int64, error)
}

type collector struct {
	worker Worker
	client *queue.Client
}

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{queueDepth, effectiveRate, configRate, rateSource, guard, paused, pauseLeft, oldest, stalled, stalledFor, accountsBacklog, served} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	ch <- prometheus.MustNewConstMetric(served, prometheus.GaugeValue, float64(c.worker.Serving()))
	if backlogs, err := c.worker.AccountBacklogs(ctx); err == nil {
		for name, n := range backlogs {
			ch <- prometheus.MustNewConstMetric(accountsBacklog, prometheus.GaugeValue, float64(n), name)
		}
	}
	for name, b := range c.worker.Buckets() {
		if st, err := b.Stats(ctx); err == nil {
			perSecond := float64(time.Second) / float64(st.Window)
			ch <- prometheus.MustNewConstMetric(effectiveRate, prometheus.GaugeValue, st.EffectiveRate*perSecond, name)
			ch <- prometheus.MustNewConstMetric(configRate, prometheus.GaugeValue, st.ConfiguredRate*perSecond, name)
			ch <- prometheus.MustNewConstMetric(rateSource, prometheus.GaugeValue, 1, name, st.Source)
			ch <- prometheus.MustNewConstMetric(guard, prometheus.GaugeValue, st.Guard.Seconds(), name)
			p := 0.0
			if st.PausedFor > 0 {
				p = 1
			}
			ch <- prometheus.MustNewConstMetric(paused, prometheus.GaugeValue, p, name)
			ch <- prometheus.MustNewConstMetric(pauseLeft, prometheus.GaugeValue, st.PausedFor.Seconds(), name)
		}
		if qs, err := c.client.QueueStats(ctx, name); err == nil {
			for state, n := range map[string]int64{"pending": qs.Pending, "active": qs.Active, "scheduled": qs.Scheduled, "retry": qs.Retry} {
				ch <- prometheus.MustNewConstMetric(queueDepth, prometheus.GaugeValue, float64(n), name, state)
			}
			ch <- prometheus.MustNewConstMetric(oldest, prometheus.GaugeValue, qs.Oldest.Seconds(), name)
			ch <- prometheus.MustNewConstMetric(stalled, prometheus.GaugeValue, float64(qs.Stalled), name)
			ch <- prometheus.MustNewConstMetric(stalledFor, prometheus.GaugeValue, qs.StalledFor.Seconds(), name)
		}
	}
}
