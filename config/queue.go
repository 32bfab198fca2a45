package config

import (
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// Queue returns the vendor as the queue package takes it: with
// PerAccount, Policy is each account's, Overrides hold the whole policy
// of each overridden account and Total the total's. Header values
// are as written (${NAME} references unexpanded): enqueueing needs no
// secrets; WorkerConfig expands them.
func (v Vendor) Queue() queue.Vendor {
	qv := queue.Vendor{
		Endpoint: vendorclients.Endpoint{Name: v.Name, BaseURL: v.BaseURL, Timeout: v.Timeout,
			MaxRetryAfter: v.MaxRetryAfter, Headers: v.Headers, UserAgent: v.UserAgent},
		Policy:      v.Policy(),
		PerAccount:  v.PerAccount,
		Total:       v.TotalPolicy(),
		QueueLimit:  v.QueueLimit,
		Concurrency: v.Concurrency,
		MaxAnswer:   v.MaxAnswer,
		KeepHeaders: v.KeepHeaders,
	}
	if len(v.Overrides) > 0 {
		qv.Overrides = make(map[string]shaper.Policy, len(v.Overrides))
		for _, o := range v.Overrides {
			qv.Overrides[o.Account] = o.apply(v).Policy()
		}
	}
	return qv
}

// ClientConfig returns the config of a queue client (enqueueing).
func (c *Config) ClientConfig() queue.ClientConfig {
	cc := queue.ClientConfig{MaxRetry: c.Worker.MaxRetry, Retention: c.Worker.Retention,
		WaitReplicas: c.Redis.WaitReplicas, WaitTimeout: c.Redis.WaitTimeout, CallbackAllow: c.Callbacks.Prefixes()}
	for _, v := range c.Vendors {
		cc.Vendors = append(cc.Vendors, v.Queue())
	}
	return cc
}

// WorkerConfig returns the config of a worker, with every vendor's header
// secrets read from the environment: a variable that is not set is an
// error naming it.
func (c *Config) WorkerConfig() (queue.WorkerConfig, error) {
	wc := queue.WorkerConfig{
		MaxWait:         c.Worker.MaxWait,
		ShutdownTimeout: c.Worker.ShutdownTimeout,
		Retention:       c.Worker.Retention,
	}
	cb, err := c.Callbacks.Expand()
	if err != nil {
		return wc, err
	}
	wc.Callbacks = cb
	for _, v := range c.Vendors {
		qv := v.Queue()
		headers, err := v.ExpandHeaders()
		if err != nil {
			return wc, err
		}
		qv.Headers = headers
		wc.Vendors = append(wc.Vendors, qv)
	}
	return wc, nil
}
