// Package queue is shaper's job runner on asynq: enqueueing vendor calls
// and user tasks bound to a vendor, and the worker that runs them. Each
// vendor is one asynq queue ("vendor:<name>", the bucket) served by its own
// asynq.Server, so a vendor's backlog or pause never delays another; every
// outbound call passes the vendor's gate, per call, not per job.
package queue

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/shaper-dev/shaper/internal/gatehook"
	"github.com/shaper-dev/shaper/shaper"
	"github.com/shaper-dev/shaper/vendorclients"
)

// TypeCall is the task type of the built-in vendor call.
const TypeCall = "vendor:call"

// Defaults.
const (
	DefaultMaxRetry  = 25
	DefaultRetention = 24 * time.Hour
	// DefaultWaitTimeout is how long an enqueue waits for replicas to
	// acknowledge it when ClientConfig.WaitReplicas is set.
	DefaultWaitTimeout = time.Second
)

// Errors returned by Enqueue, matched with errors.Is.
var (
	ErrUnknownVendor = errors.New("queue: unknown vendor")
	ErrQueueFull     = errors.New("queue: vendor queue is full")
	ErrDuplicate     = errors.New("queue: a call with this id is already queued")
	ErrBadCall       = errors.New("queue: invalid call")
	// ErrNotReplicated: the calls are queued on the master, but fewer
	// replicas than ClientConfig.WaitReplicas acknowledged them in time.
	ErrNotReplicated = errors.New("queue: enqueued on the Redis master only")
)

// Call is one HTTP call to a vendor.
type Call struct {
	Vendor string `json:"vendor"`
	// Account names the account of a per-account vendor the call belongs
	// to (its bucket); calls to other vendors have none.
	Account string `json:"account,omitempty"`
	// ID, when set, makes enqueueing idempotent: it becomes the task id
	// and the Idempotency-Key header, and a second call with the same id
	// is refused with ErrDuplicate while the first is kept.
	ID      string            `json:"id,omitempty"`
	Method  string            `json:"method"` // default GET
	Path    string            `json:"path"`   // relative to the vendor's base_url
	Headers map[string]string `json:"headers,omitempty"`
	// Body is sent as is; a JSON body gets Content-Type: application/json
	// unless Headers set one.
	Body   json.RawMessage `json:"body,omitempty"`
	Export string          `json:"export,omitempty"` // the export it belongs to, if any
	// Cost is the units the call uses of every limit of its bucket (and of
	// a per-account vendor's total): 1 when 0, at most the smallest rate
	// among them.
	Cost int `json:"cost,omitempty"`
	// Priority is the call's lane: "high" goes ahead of every normal call
	// of its bucket that has not started yet; "" or "normal" is the
	// default. High calls can starve normal ones.
	Priority string `json:"priority,omitempty"`
	// Callback, when set, has the call's outcome POSTed to its URL when
	// the call ends (see Outcome); the URL must be under a prefix of the
	// config's [callbacks] allow.
	Callback *Callback `json:"callback,omitempty"`
	// Next, when set, makes the call the first page of a paginated pull:
	// when it succeeds and its answer names a next page, the worker
	// queues that page as a call of its own (see pull.go), up to MaxPages
	// pages (default DefaultMaxPages).
	Next     *Next `json:"next,omitempty"`
	MaxPages int   `json:"max_pages,omitempty"`
	// Pull is where a page of a pull stands; the worker sets it on the
	// pages it queues, and Validate refuses it anywhere else.
	Pull *PullPage `json:"pull,omitempty"`
	// Seq is the call's place in its export (ExportCalls' order), set by
	// StartExport.
	Seq int64 `json:"seq,omitempty"`

	line int // its line in a call file (ParseCalls), for errors
}

var (
	methodRe = regexp.MustCompile(`^[A-Z]+$`)
	idRe     = regexp.MustCompile(`^[A-Za-z0-9._:@/+=-]{1,200}$`)
)

// Validate reports what is wrong with c, without the vendor check.
func (c *Call) Validate() error {
	if c.Method == "" {
		c.Method = http.MethodGet
	}
	if !methodRe.MatchString(c.Method) {
		return fmt.Errorf("%w: method %q: want an upper-case HTTP method such as GET or POST", ErrBadCall, c.Method)
	}
	if err := vendorclients.CheckPath(c.Path); err != nil {
		return fmt.Errorf("%w: path: %w", ErrBadCall, err)
	}
	if c.ID != "" && !idRe.MatchString(c.ID) {
		return fmt.Errorf("%w: id %q: use 1-200 letters, digits and ._:@/+=-", ErrBadCall, c.ID)
	}
	for k := range c.Headers {
		if k == "" || strings.ContainsAny(k, " :\r\n") {
			return fmt.Errorf("%w: header name %q", ErrBadCall, k)
		}
		if strings.EqualFold(k, "Idempotency-Key") {
			return fmt.Errorf("%w: header Idempotency-Key is set by shaper from the task id; give the call an id instead", ErrBadCall)
		}
	}
	for k, v := range c.Headers {
		if strings.ContainsAny(v, "\r\n") {
			return fmt.Errorf("%w: header %s has a line break", ErrBadCall, k)
		}
	}
	if len(c.Body) > 0 && !json.Valid(c.Body) {
		return fmt.Errorf("%w: body is not valid JSON", ErrBadCall)
	}
	if c.Cost < 0 {
		return fmt.Errorf("%w: cost %d: a cost is a whole number of units, at least 1 (the default)", ErrBadCall, c.Cost)
	}
	if _, err := ParseLane(c.Priority); err != nil {
		return fmt.Errorf("%w: %w", ErrBadCall, err)
	}
	if c.Callback != nil {
		if _, err := checkCallbackURL(c.Callback.URL); err != nil {
			return fmt.Errorf("%w: %w", ErrBadCall, err)
		}
	}
	if c.Pull != nil {
		return fmt.Errorf("%w: \"pull\" is set by the worker on the pages it queues; a call says how to find its next page with \"next\"", ErrBadCall)
	}
	return c.checkNext()
}

// ParseLane reads a priority: "high", or "normal" (also for "").
func ParseLane(s string) (shaper.Lane, error) {
	switch s {
	case "", "normal":
		return shaper.Normal, nil
	case "high":
		return shaper.High, nil
	}
	return shaper.Normal, fmt.Errorf("priority %q: want \"high\" or \"normal\" (the default)", s)
}

// lane is the call's lane (Validate has checked Priority).
func (c Call) lane() shaper.Lane {
	l, _ := ParseLane(c.Priority)
	return l
}

// ClientConfig configures a Client.
type ClientConfig struct {
	Vendors   []Vendor      // the client reads Name and QueueLimit
	MaxRetry  int           // retries of failed calls (not of waits or 429s); default 25
	Retention time.Duration // how long finished calls are kept; default 24h
	KeyPrefix string        // gate and export keys; default "shaper"
	// WaitReplicas, when above 0, makes Enqueue, EnqueueBatch,
	// EnqueueTask and StartExport wait (Redis WAIT, once per batch) until
	// that many replicas hold what they queued, for at most WaitTimeout (default
	// DefaultWaitTimeout): a failover right after a successful enqueue
	// then loses nothing. Fewer acknowledgements return ErrNotReplicated.
	// Not for Redis Cluster.
	WaitReplicas int
	WaitTimeout  time.Duration
	// CallbackAllow lists the URL prefixes a call's callback may name
	// ([callbacks] allow); with none, a call with a callback is refused.
	CallbackAllow []string
	// Gate, when set, is the gate on rdb, of KeyPrefix, that the client
	// plans per-account backlogs with; nil makes one. A process that
	// makes a client per config reload shares one gate among them (a gate
	// keeps what it learned of the servers).
	Gate *shaper.Gate
}

// Client enqueues calls and tasks.
type Client struct {
	rdb     redis.UniversalClient
	aq      *asynq.Client
	vendors map[string]Vendor
	cfg     ClientConfig
	gate    *shaper.Gate // plans per-account backlogs
	signals signaller    // tells workers which vendors have work
	stamps  stamper      // the calls' enqueue stamps
	// claimSafe and renewEvery are the constants, but for a test.
	claimSafe, renewEvery time.Duration
}

// NewClient returns a client on rdb. Close it when done; it never closes
// rdb.
func NewClient(rdb redis.UniversalClient, cfg ClientConfig) *Client {
	if cfg.MaxRetry <= 0 {
		cfg.MaxRetry = DefaultMaxRetry
	}
	if cfg.Retention <= 0 {
		cfg.Retention = DefaultRetention
	}
	if cfg.KeyPrefix == "" {
		cfg.KeyPrefix = shaper.DefaultKeyPrefix
	}
	if cfg.WaitTimeout <= 0 {
		cfg.WaitTimeout = DefaultWaitTimeout
	}
	gate := cfg.Gate
	if gate == nil {
		gate = shaper.NewGate(rdb, shaper.Config{KeyPrefix: cfg.KeyPrefix})
	}
	c := &Client{rdb: rdb, aq: asynq.NewClientFromRedisClient(rdb), vendors: map[string]Vendor{}, cfg: cfg,
		gate: gate, signals: signaller{last: map[string]time.Time{}}, claimSafe: claimSafe, renewEvery: renewEvery}
	for _, v := range cfg.Vendors {
		c.vendors[v.Name] = v
	}
	return c
}

// Close releases the client.
func (c *Client) Close() error { return c.aq.Close() }

func (c *Client) vendor(name string) (Vendor, error) {
	v, ok := c.vendors[name]
	if !ok {
		known := make([]string, 0, len(c.vendors))
		for n := range c.vendors {
			known = append(known, n)
		}
		return Vendor{}, fmt.Errorf("%w %q: configured vendors are %s", ErrUnknownVendor, name, strings.Join(known, ", "))
	}
	return v, nil
}

// Waiting returns how many tasks wait in or run from the vendor's queue:
// pending, active, scheduled and retry.
func (c *Client) Waiting(ctx context.Context, vendor string) (int64, error) {
	st, err := readQueueStats(ctx, c.rdb, vendor, queueCounts)
	return st.Pending + st.Active + st.Scheduled + st.Retry, err
}

// Enqueue validates call and queues it on its vendor, returning the task
// id. It fails with ErrUnknownVendor, ErrQueueFull, ErrBadCall,
// ErrInProgress, or ErrDuplicate with the id: the id names a call of the
// vendor already queued, in either lane, and nothing was added.
func (c *Client) Enqueue(ctx context.Context, call Call) (string, error) {
	if err := c.checkCall(&call); err != nil {
		return "", err
	}
	res, err := c.enqueueGroups(ctx, []Call{call}, []vendorGroup{{call.Vendor, []int{0}}})
	one := res.Calls[0]
	switch {
	case one.State == StateNotQueued && one.Err != nil:
		return "", one.Err
	case one.State == StateNotQueued:
		return "", err
	case one.State == StateAlreadyQueued:
		return one.ID, fmt.Errorf("%w (%s, %s lane)", ErrDuplicate, call.Vendor, one.Lane)
	}
	return one.ID, err
}

// planLead is how long before its planned tick a call planned for later
// comes back from the queue's schedule. asynq keeps schedules in whole
// seconds: a call is scheduled at the whole second at or after its tick
// less planLead, and is forwarded within perAccountForward of it, so it
// comes back between planLead and planLead - 1s - perAccountForward
// before its tick: early enough to take it, and holding a goroutine for
// about a second, not longer.
const planLead = 1100 * time.Millisecond

// plan returns, for each call of a per-account vendor, how long from now
// it should wait in the queue's schedule: its account's plan (see
// gatehook.Plan) less planLead, or 0 to be picked up at once. A long
// backlog of one account then waits in the schedule, not in front of the
// other accounts' calls. Calls to other vendors are not planned.
func (c *Client) plan(ctx context.Context, vendor string, calls []Call) ([]time.Duration, error) {
	at := make([]time.Duration, len(calls))
	v, err := c.vendor(vendor)
	if err != nil || !v.PerAccount {
		return at, err
	}
	group, err := c.gate.Group(bucketName(vendor), v.Total)
	if err != nil {
		return nil, fmt.Errorf("queue: vendor %s: %w", vendor, err)
	}
	byAccount := map[string][]int{}
	for i, call := range calls {
		if call.lane() == shaper.High {
			continue // a high call goes ahead of the planned ones: it is picked up at once
		}
		byAccount[call.Account] = append(byAccount[call.Account], i)
	}
	for account, idx := range byAccount {
		b, err := group.Bucket(account, accountPolicy(v.Policy, v.Overrides, account))
		if err != nil {
			return nil, fmt.Errorf("queue: vendor %s, account %s: %w", vendor, account, err)
		}
		first, pace, err := gatehook.Plan(ctx, b, len(idx))
		if err != nil {
			return nil, fmt.Errorf("queue: %w", err)
		}
		for k, i := range idx {
			at[i] = max(first+time.Duration(k)*pace-planLead, 0)
		}
	}
	return at, nil
}

func (c *Client) enqueueChecked(ctx context.Context, call Call, at time.Duration) (string, error) {
	payload, err := json.Marshal(call)
	if err != nil {
		return "", fmt.Errorf("%w: %w", ErrBadCall, err)
	}
	opts := append(taskIDOption(call.ID), laneOption(call.lane()))
	if at > 0 {
		opts = append(opts, asynq.ProcessAt(wholeSecondAfter(time.Now().Add(at))))
	}
	info, err := c.enqueueTask(ctx, Target{Vendor: call.Vendor, Account: call.Account}, asynq.NewTask(TypeCall, payload), opts...)
	if err != nil {
		return call.ID, err
	}
	return info.ID, nil
}

// wholeSecondAfter rounds t up to a whole second: asynq truncates a
// schedule to its second, which would bring a call back up to a second
// early.
func wholeSecondAfter(t time.Time) time.Time {
	if w := t.Truncate(time.Second); !w.Equal(t) {
		return w.Add(time.Second)
	}
	return t
}

func taskIDOption(id string) []asynq.Option {
	if id == "" {
		return nil
	}
	return []asynq.Option{asynq.TaskID(id)}
}

// Target is where a task goes: a vendor, and for a per-account vendor one
// of its accounts.
type Target struct {
	Vendor  string
	Account string
}

// accountHeader, costHeader and laneHeader carry a task's account, cost
// and lane (a task of the user's own type has no payload of shaper's).
const (
	accountHeader = "shaper-account"
	costHeader    = "shaper-cost"
	laneHeader    = "shaper-priority"
)

// Cost is an option of EnqueueTask: every call the task's handler makes
// through the vendor's client costs n units of its limits (default 1).
func Cost(n int) asynq.Option { return costOption(n) }

// Priority is an option of EnqueueTask: the task's lane (shaper.High goes
// ahead of the vendor's normal tasks that have not started).
func Priority(l shaper.Lane) asynq.Option { return laneOption(l) }

type costOption int

func (o costOption) String() string         { return fmt.Sprintf("Cost(%d)", int(o)) }
func (o costOption) Type() asynq.OptionType { return -1 }
func (o costOption) Value() any             { return int(o) }

type laneOption shaper.Lane

func (o laneOption) String() string         { return fmt.Sprintf("Priority(%s)", shaper.Lane(o)) }
func (o laneOption) Type() asynq.OptionType { return -2 }
func (o laneOption) Value() any             { return shaper.Lane(o) }

// callOptions are shaper's options of a task.
type callOptions struct {
	cost int
	lane shaper.Lane
}

// splitOptions takes shaper's options out of opts, for asynq.
func splitOptions(opts []asynq.Option) (callOptions, []asynq.Option) {
	var co callOptions
	rest := make([]asynq.Option, 0, len(opts))
	for _, o := range opts {
		switch o := o.(type) {
		case costOption:
			co.cost = int(o)
		case laneOption:
			co.lane = shaper.Lane(o)
		default:
			rest = append(rest, o)
		}
	}
	return co, rest
}

// EnqueueTask queues a task of the user's own type on the target vendor's
// queue (and account's bucket), with shaper's retry budget and retention;
// opts may override them. Register its handler with Worker.Handle. With
// WaitReplicas set, the task is queued even when ErrNotReplicated is
// returned (with its info). Cost and Priority set what its calls cost and
// its lane; a cost no limit of the vendor admits is refused. Pass asynq's
// options here rather than to asynq.NewTask: a task that carries shaper's
// headers (an account, a cost, the high lane, a trace context) is rebuilt
// with them, and asynq cannot read back the options a task was made with.
// A task id (asynq.TaskID) names one task of the vendor, whatever its
// lane, as a call's id does: a task whose id the vendor holds in either
// lane is ErrDuplicate, one another enqueue is queueing ErrInProgress.
func (c *Client) EnqueueTask(ctx context.Context, to Target, t *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	co, rest := splitOptions(opts)
	id, lane := "", co.lane
	for _, o := range rest {
		if o.Type() == asynq.TaskIDOpt {
			id, _ = o.Value().(string)
		}
	}
	if id == "" {
		info, err := c.enqueueTask(ctx, to, t, opts...)
		if err != nil {
			return nil, err
		}
		return info, c.replicated(ctx, 1)
	}
	if err := c.checkAccount(to.Vendor, to.Account); err != nil {
		return nil, err
	}
	calls := []Call{{ID: id, Priority: lane.String()}}
	res := BatchResult{Calls: []BatchCall{{ID: id, State: StateNotQueued, Lane: lane.String()}}}
	mine, err := c.claimCalls(ctx, to.Vendor, calls, []int{0}, &res)
	switch {
	case err != nil:
		if mine[0] != 0 {
			c.releaseClaims(ctx, to.Vendor, []string{id})
		}
		return nil, err
	case res.Calls[0].State == StateAlreadyQueued:
		return nil, fmt.Errorf("%w (%s, %s lane)", ErrDuplicate, to.Vendor, res.Calls[0].Lane)
	case mine[0] == 0:
		return nil, res.Calls[0].Err
	}
	info, err := c.enqueueTask(ctx, to, t, opts...)
	c.releaseClaims(ctx, to.Vendor, []string{id}) // queued (the task holds its id), a duplicate, or not queued
	if err != nil {
		return nil, err
	}
	return info, c.replicated(ctx, 1)
}

// enqueueTask is EnqueueTask without waiting for replicas (a batch waits
// once, at its end).
func (c *Client) enqueueTask(ctx context.Context, to Target, t *asynq.Task, opts ...asynq.Option) (*asynq.TaskInfo, error) {
	if err := c.checkAccount(to.Vendor, to.Account); err != nil {
		return nil, err
	}
	call, opts := splitOptions(opts)
	rebuilt := t.Type() == TypeCall // a task whose asynq.NewTask options nothing needs
	if t.Type() != TypeCall {       // a call's payload names its account, cost and lane
		if err := c.checkCost(to.Vendor, to.Account, call.cost); err != nil {
			return nil, err
		}
		headers := maps.Clone(t.Headers())
		if headers == nil {
			headers = map[string]string{}
		}
		if to.Account != "" {
			headers[accountHeader] = to.Account
		}
		if call.cost > 1 {
			headers[costHeader] = strconv.Itoa(call.cost)
		}
		if call.lane == shaper.High {
			headers[laneHeader] = "high"
		}
		if len(headers) > 0 {
			t, rebuilt = asynq.NewTaskWithHeaders(t.Type(), t.Payload(), headers), true
		}
	}
	all := append([]asynq.Option{asynq.Queue(laneQueue(to.Vendor, call.lane)), asynq.MaxRetry(c.cfg.MaxRetry), asynq.Retention(c.cfg.Retention)}, opts...)
	if rebuilt {
		t, all = withRetryHeadroom(t, all) // a deferral always finds a retry left (retry.go)
	}
	info, err := c.aq.EnqueueContext(ctx, traced(ctx, t, &c.stamps), all...)
	if errors.Is(err, asynq.ErrTaskIDConflict) {
		return nil, fmt.Errorf("%w (%s)", ErrDuplicate, to.Vendor)
	}
	if err != nil {
		return nil, fmt.Errorf("queue: enqueue on %s: %w", to.Vendor, err)
	}
	c.signal(ctx, to.Vendor)
	return info, nil
}

// CheckCalls validates calls, all on vendor, as EnqueueBatch does before
// it queues anything: every bad call is reported (as a *LineError when
// it came from a call file), joined; an unknown vendor is
// ErrUnknownVendor.
func (c *Client) CheckCalls(vendor string, calls []Call) error { return c.checkCalls(vendor, calls) }

// checkCalls validates calls, all on vendor, and reports every bad one
// (as a *LineError when the call came from a call file), joined.
func (c *Client) checkCalls(vendor string, calls []Call) error {
	var errs []error
	for i := range calls {
		calls[i].Vendor = vendor
		err := c.checkCall(&calls[i])
		if errors.Is(err, ErrUnknownVendor) {
			return err
		}
		switch {
		case err == nil:
		case calls[i].line > 0:
			errs = append(errs, &LineError{Line: calls[i].line, Err: err})
		default:
			errs = append(errs, fmt.Errorf("call %d: %w", i+1, err))
		}
	}
	return errors.Join(errs...)
}

// checkCall validates one call: its fields, its account, its cost and
// its callback.
func (c *Client) checkCall(call *Call) error {
	if err := call.Validate(); err != nil {
		return err
	}
	if err := c.checkAccount(call.Vendor, call.Account); err != nil {
		return err
	}
	if err := c.checkCost(call.Vendor, call.Account, call.Cost); err != nil {
		return err
	}
	return checkCallback(c.cfg.CallbackAllow, call.Callback)
}

// checkCost checks that a call of cost units to vendor (and account) can
// ever start: no more than the smallest rate among its bucket's limits
// and its vendor's total.
func (c *Client) checkCost(vendor, account string, cost int) error {
	if cost <= 1 {
		return nil
	}
	v, err := c.vendor(vendor)
	if err != nil {
		return err
	}
	p := v.Policy
	if v.PerAccount {
		p = accountPolicy(v.Policy, v.Overrides, account)
	}
	where := "vendor " + vendor
	if account != "" {
		where += ", account " + account
	}
	limits := p.Limits
	if v.Total != nil {
		limits = append(slices.Clone(limits), v.Total.Limits...)
	}
	for _, l := range limits {
		if cost > l.Rate {
			return fmt.Errorf("%w: cost %d is above %s's limit of %s: a call that costs more than a limit allows in its window could never start; split it, or check the cost",
				ErrBadCall, cost, where, l)
		}
	}
	return nil
}

// checkAccount checks that a call to vendor names an account exactly when
// the vendor is per-account, and that the account is valid there.
func (c *Client) checkAccount(vendor, account string) error {
	v, err := c.vendor(vendor)
	if err != nil {
		return err
	}
	switch {
	case v.PerAccount && account == "":
		return fmt.Errorf("%w: vendor %s limits each account on its own: the call needs an account (\"account\" in a call line, --account, Call.Account)", ErrBadCall, vendor)
	case !v.PerAccount && account != "":
		return fmt.Errorf("%w: vendor %s is not per-account (per_account = true in its config): the call must not name an account, and it names %q", ErrBadCall, vendor, account)
	case account == "":
		return nil
	}
	if err := CheckAccount(account); err != nil {
		return fmt.Errorf("%w: vendor %s: %w", ErrBadCall, vendor, err)
	}
	if _, err := vendorclients.AccountBaseURL(v.BaseURL, account); err != nil {
		return fmt.Errorf("%w: vendor %s: %w", ErrBadCall, vendor, err)
	}
	return nil
}

// BatchResult says what EnqueueBatch or EnqueueCalls did: the counts,
// the ids queued now, and each call's state.
type BatchResult struct {
	Enqueued      int
	AlreadyQueued int
	IDs           []string // the ids of the calls queued now, in order
	// Calls says what became of each call, in the order given.
	Calls []BatchCall
}

// States of a call of a batch (BatchCall.State).
const (
	StateQueued        = "queued"         // queued now
	StateAlreadyQueued = "already_queued" // its id names a call of the vendor queued before: nothing was added
	StateNotQueued     = "not_queued"     // not queued (BatchCall.Err says why): post it again
)

// BatchCall is what became of one call of a batch.
type BatchCall struct {
	// ID is the call's task id: its own, or the one made for it when it
	// was queued ("" for a call without an id that was not).
	ID    string
	State string
	// Lane is the lane the call is in: for an id already queued, the
	// lane of the call that holds it.
	Lane string
	Err  error // why it was not queued
}

// EnqueueBatch queues calls, all on one vendor, as EnqueueCalls does.
func (c *Client) EnqueueBatch(ctx context.Context, vendor string, calls []Call) (BatchResult, error) {
	if err := c.checkCalls(vendor, calls); err != nil {
		return BatchResult{}, err
	}
	idx := make([]int, len(calls))
	for i := range idx {
		idx[i] = i
	}
	return c.enqueueGroups(ctx, calls, []vendorGroup{{vendor, idx}})
}

// EnqueueCalls queues calls that each name their vendor, one vendor or
// several, as one request:
//
//   - every call is checked first; with a bad one nothing is queued (the
//     errors joined, as *LineError for calls from a call file);
//   - room for every call is reserved in each vendor's queue_limit
//     before any is queued, so a full queue refuses the whole request
//     (ErrQueueFull) and never a part of it, and requests side by side
//     never pass queue_limit together;
//   - a call whose id names a call of its vendor already queued, in
//     either lane and for any account, is not queued again
//     (StateAlreadyQueued);
//   - then the calls are queued in order. An error past this point (Redis,
//     the context) stops it: the result's Calls say exactly which calls
//     were queued and which were not, with the error.
func (c *Client) EnqueueCalls(ctx context.Context, calls []Call) (BatchResult, error) {
	var groups []vendorGroup
	at := map[string]int{}
	for i, call := range calls {
		g, ok := at[call.Vendor]
		if !ok {
			g = len(groups)
			at[call.Vendor] = g
			groups = append(groups, vendorGroup{vendor: call.Vendor})
		}
		groups[g].idx = append(groups[g].idx, i)
	}
	var errs []error
	for _, g := range groups {
		own := make([]Call, len(g.idx))
		for k, i := range g.idx {
			own[k] = calls[i]
		}
		if err := c.checkCalls(g.vendor, own); err != nil {
			if errors.Is(err, ErrUnknownVendor) {
				return BatchResult{}, err
			}
			if j, ok := err.(interface{ Unwrap() []error }); ok {
				errs = append(errs, j.Unwrap()...) // one join of every bad call
			} else {
				errs = append(errs, err)
			}
			continue
		}
		for k, i := range g.idx {
			calls[i] = own[k]
		}
	}
	if err := errors.Join(errs...); err != nil {
		return BatchResult{}, err
	}
	return c.enqueueGroups(ctx, calls, groups)
}

// vendorGroup is the calls of one vendor in a request, by their index.
type vendorGroup struct {
	vendor string
	idx    []int
}

// enqueueGroups queues checked calls, grouped by vendor: room for them
// all first, then each group in chunks (see EnqueueCalls).
func (c *Client) enqueueGroups(ctx context.Context, calls []Call, groups []vendorGroup) (BatchResult, error) {
	res := BatchResult{Calls: make([]BatchCall, len(calls))}
	for i, call := range calls {
		res.Calls[i] = BatchCall{ID: call.ID, State: StateNotQueued, Lane: call.lane().String()}
	}
	held := make([]*reservation, len(groups))
	defer func() {
		for _, r := range held {
			c.release(ctx, r)
		}
	}()
	for g, grp := range groups {
		v, err := c.vendor(grp.vendor)
		if err == nil {
			held[g], err = c.reserve(ctx, v, len(grp.idx))
		}
		if err != nil {
			return res.failed(err)
		}
	}
	up := &upkeep{at: time.Now()}
	for g, grp := range groups {
		up.rooms = held[g:] // a long request keeps the room of the vendors still to come
		for start := 0; start < len(grp.idx); start += chunkSize {
			if err := c.enqueueChunk(ctx, grp.vendor, calls, grp.idx[start:min(start+chunkSize, len(grp.idx))], up, &res); err != nil {
				return res.failed(err)
			}
		}
	}
	busy := 0
	for _, call := range res.Calls {
		if call.State == StateNotQueued {
			busy++
		}
	}
	err := c.replicated(ctx, res.Enqueued)
	if busy > 0 {
		err = errors.Join(fmt.Errorf("%w: %d call(s) not queued, whose ids another request was queueing; the others are (%d queued, %d already)",
			ErrInProgress, busy, res.Enqueued, res.AlreadyQueued), err)
	}
	return res, err
}

// failed marks every call not queued yet with err, and returns err.
func (r BatchResult) failed(err error) (BatchResult, error) {
	for i := range r.Calls {
		if r.Calls[i].State == StateNotQueued && r.Calls[i].Err == nil {
			r.Calls[i].Err = err
		}
	}
	return r, err
}

// upkeep is what an enqueue under way renews every renewEvery: the room
// reserved for the vendors it has still to queue, and the claims of the
// chunk's ids it has still to queue.
type upkeep struct {
	rooms []*reservation // of the vendors still to queue, this one first
	at    time.Time      // when the rooms were last renewed (or reserved)
}

// enqueueChunk queues the calls of vendor at idx: it claims their ids,
// leaves out those already queued, plans the rest (a per-account
// vendor) and queues them in order, recording each in res. Every
// c.renewEvery it renews what up holds and the claims it has still to
// use; past c.claimSafe from the last renewal (a Redis that did not
// answer), it stops.
func (c *Client) enqueueChunk(ctx context.Context, vendor string, calls []Call, idx []int, up *upkeep, res *BatchResult) error {
	start := time.Now()                       // the claims are made after it
	firstOf := make(map[string]int, len(idx)) // an id's first call in the chunk
	var claiming []int
	var again []int // calls whose id came earlier in the chunk
	for _, i := range idx {
		id := calls[i].ID
		if id == "" {
			continue
		}
		if _, seen := firstOf[id]; seen {
			again = append(again, i)
			continue
		}
		firstOf[id] = i
		claiming = append(claiming, i)
	}
	mine, err := c.claimCalls(ctx, vendor, calls, claiming, res)
	if err != nil {
		var held []string
		for i := range mine {
			held = append(held, calls[i].ID)
		}
		c.releaseClaims(ctx, vendor, held)
		return err
	}
	var todo []int // the calls to queue, in order
	for _, i := range idx {
		if calls[i].ID == "" || mine[i] != 0 {
			todo = append(todo, i)
		}
	}
	unqueued := func(from int) []string {
		var ids []string
		for _, i := range todo[from:] {
			if calls[i].ID != "" {
				ids = append(ids, calls[i].ID)
			}
		}
		return ids
	}
	at := make([]time.Duration, len(todo))
	if v, _ := c.vendor(vendor); v.PerAccount { // only a per-account vendor plans
		planned := make([]Call, len(todo))
		for k, i := range todo {
			planned[k] = calls[i]
		}
		at, err = c.plan(ctx, vendor, planned)
	}
	if err != nil {
		c.releaseClaims(ctx, vendor, unqueued(0))
		return err
	}
	var done []string // ids queued now: their calls hold them, their claims go at the end
	defer func() { c.releaseClaims(ctx, vendor, done) }()
	renew := func(k int) error {
		if time.Since(start) > c.claimSafe {
			return fmt.Errorf("queue: queueing calls on %s: Redis took over %s to answer, and the claims of the %d ids not queued yet could lapse; they were not queued, post them again",
				vendor, c.claimSafe, len(unqueued(k)))
		}
		now := time.Now()
		for _, r := range up.rooms {
			if err := c.renew(ctx, r); err != nil {
				return err
			}
		}
		up.at = now
		var held []int // the calls still to queue whose ids this enqueue claimed
		for _, i := range todo[k:] {
			if mine[i] != 0 {
				held = append(held, i)
			}
		}
		ids, scores := make([]string, len(held)), make([]int64, len(held))
		for j, i := range held {
			ids[j], scores[j] = calls[i].ID, mine[i]
		}
		if err := c.renewClaims(ctx, vendor, ids, scores); err != nil {
			return err
		}
		for j, i := range held {
			mine[i] = scores[j]
		}
		start = now
		return nil
	}
	for k, i := range todo {
		if time.Since(start) > c.renewEvery || time.Since(up.at) > c.renewEvery {
			if err := renew(k); err != nil {
				c.releaseClaims(ctx, vendor, unqueued(k))
				return err
			}
		}
		id, err := c.enqueueChecked(ctx, calls[i], at[k])
		switch {
		case errors.Is(err, ErrDuplicate): // queued by an enqueue that takes no claims (an older shaper)
			res.Calls[i].State = StateAlreadyQueued
			res.AlreadyQueued++
		case err != nil:
			c.releaseClaims(ctx, vendor, unqueued(k))
			return err
		default:
			res.Calls[i].ID, res.Calls[i].State = id, StateQueued
			res.Enqueued++
			res.IDs = append(res.IDs, id)
		}
		if mine[i] != 0 {
			done = append(done, calls[i].ID)
		}
	}
	for _, i := range again {
		first := res.Calls[firstOf[calls[i].ID]]
		if first.State != StateNotQueued {
			res.Calls[i].State, res.Calls[i].Lane = StateAlreadyQueued, first.Lane
			res.AlreadyQueued++
		} else {
			res.Calls[i].Err = first.Err
		}
	}
	return nil
}

// claimCalls claims the ids of the calls at idx (each id once) and
// returns those whose claim this enqueue holds and whose id is in neither
// of the vendor's lanes, each with its claim's score: the calls to queue. A call whose id is queued, in either lane, is recorded in
// res as already queued. A call whose id another request holds is waited
// for, up to claimWait: once that call is in its lane it is already
// queued; if the claim goes away (that request failed) it is claimed
// again; past claimWait it is not queued (ErrInProgress). A claim whose
// holder gave up (claimStale) is dropped and the id claimed again.
func (c *Client) claimCalls(ctx context.Context, vendor string, calls []Call, idx []int, res *BatchResult) (map[int]int64, error) {
	mine := make(map[int]int64, len(idx))
	deadline := time.Now().Add(claimWait)
	for len(idx) > 0 {
		ids := make([]string, len(idx))
		lanes := make([]shaper.Lane, len(idx))
		for k, i := range idx {
			ids[k], lanes[k] = calls[i].ID, calls[i].lane()
		}
		now, claims, err := c.claimIDs(ctx, vendor, ids, lanes)
		if err != nil {
			return mine, err
		}
		// Where to look: an id claimed now in both lanes (a call queued
		// before its claim lapsed, or before claims), another's claim in
		// its lane.
		var look [2][]string // task keys by lane bit
		var whose [2][]int   // k of each key
		for k, cl := range claims {
			if cl.mine {
				mine[idx[k]] = cl.score
			}
			for _, l := range []shaper.Lane{shaper.Normal, shaper.High} {
				if cl.mine || cl.lane == l {
					look[laneBit(l)] = append(look[laneBit(l)], asynqTaskKey(laneQueue(vendor, l), ids[k]))
					whose[laneBit(l)] = append(whose[laneBit(l)], k)
				}
			}
		}
		found, err := c.queuedIn(ctx, look[:])
		if err != nil {
			return mine, err
		}
		queuedAt := make([]int, len(idx)) // 0: in no lane, else lane bit + 1
		for b := range found {
			for j, ok := range found[b] {
				if ok {
					queuedAt[whose[b][j]] = b + 1
				}
			}
		}
		var there []string // claimed now, and queued already: no claim needed
		var stale []string
		var staleScores []int64
		var waiting []int
		var waitingFor []idClaim
		for k, i := range idx {
			cl := claims[k]
			switch {
			case queuedAt[k] > 0:
				l := shaper.Normal
				if queuedAt[k] == 2 {
					l = shaper.High
				}
				res.Calls[i].State, res.Calls[i].Lane = StateAlreadyQueued, l.String()
				res.AlreadyQueued++
				if cl.mine {
					delete(mine, i)
					there = append(there, ids[k])
				}
			case cl.mine:
			case now-cl.at > claimStale.Milliseconds():
				stale, staleScores = append(stale, ids[k]), append(staleScores, cl.score)
				waiting, waitingFor = append(waiting, i), append(waitingFor, cl)
			default:
				waiting, waitingFor = append(waiting, i), append(waitingFor, cl)
			}
		}
		c.releaseClaims(ctx, vendor, there)
		if len(stale) > 0 {
			if err := c.dropStale(ctx, vendor, stale, staleScores); err != nil {
				return mine, err
			}
		}
		idx = waiting
		switch {
		case len(idx) == 0:
		case len(stale) == len(idx):
			continue // claim them again at once
		case time.Now().After(deadline):
			for k, i := range idx {
				cl := waitingFor[k]
				res.Calls[i].Err = fmt.Errorf("%w: call %s of %s was claimed %s ago for the %s lane and is not queued yet; post it again in a moment",
					ErrInProgress, calls[i].ID, vendor, time.Duration(now-cl.at)*time.Millisecond, cl.lane)
			}
			idx = nil
		default:
			select {
			case <-ctx.Done():
				return mine, ctx.Err()
			case <-time.After(claimPoll):
			}
		}
	}
	return mine, nil
}

// replicated waits until cfg.WaitReplicas replicas hold every write made
// so far, when it is set. WAIT counts the writes of its own connection,
// and replication is one ordered stream: a small write followed by WAIT on
// one connection covers the enqueue's writes made on others before it.
func (c *Client) replicated(ctx context.Context, n int) error {
	if c.cfg.WaitReplicas <= 0 || n == 0 {
		return nil
	}
	rc, ok := c.rdb.(*redis.Client)
	if !ok {
		return fmt.Errorf("queue: WaitReplicas needs a single Redis or Sentinel, not a %T", c.rdb)
	}
	conn := rc.Conn()
	defer conn.Close()
	var acked *redis.Cmd
	_, err := conn.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.Set(ctx, c.cfg.KeyPrefix+":replicated", time.Now().UnixMicro(), time.Minute)
		acked = p.Do(ctx, "WAIT", c.cfg.WaitReplicas, c.cfg.WaitTimeout.Milliseconds())
		return nil
	})
	if err != nil {
		return fmt.Errorf("%w: %d call(s) queued, but waiting for %d replica(s) failed: %w; a failover now could lose them (enqueueing calls with ids again is safe)",
			ErrNotReplicated, n, c.cfg.WaitReplicas, err)
	}
	if got, _ := acked.Int64(); got < int64(c.cfg.WaitReplicas) {
		return fmt.Errorf("%w: %d call(s) queued, but %d of the %d replica(s) asked for (redis.wait_replicas) acknowledged them within %s; a failover now could lose them (enqueueing calls with ids again is safe)",
			ErrNotReplicated, n, got, c.cfg.WaitReplicas, c.cfg.WaitTimeout)
	}
	return nil
}

// QueueStats is the asynq side of a vendor's bucket.
type QueueStats struct {
	Pending   int64 // waiting to be picked up
	Active    int64 // held by a worker: waiting for a tick or calling
	Scheduled int64
	Retry     int64         // waiting for a retry (failures, and waits sent back to the queue)
	Oldest    time.Duration // age of the oldest pending call of the normal lane (0: none)
	// HighPending counts the pending calls of the high lane (in Pending
	// too); Active and Retry count both lanes.
	HighPending int64
	// Stalled counts the active calls (both lanes) whose lease no worker
	// renewed for over StallAfter: their worker died or lost Redis, and
	// asynq gives them back only once the lease is 30 s past due (1-2
	// minutes); StalledFor is the longest since a renewal.
	Stalled    int64
	StalledFor time.Duration
}

// StallAfter is how long an active call's lease goes without a renewal
// before the call counts as stalled: asynq renews the leases of a live
// worker's calls every 5 s, for 30 s (asynq v0.26 heartbeat.go,
// rdb.LeaseDuration).
const StallAfter = 10 * time.Second

// asynqLease is asynq v0.26's lease duration (rdb.LeaseDuration): a
// lease's score (Unix seconds) is its last renewal plus this.
const asynqLease = 30 * time.Second

// QueueStats reads a vendor's queue, its stalled calls included: one
// round trip, and one more for the age of the oldest pending call when
// there is one.
func (c *Client) QueueStats(ctx context.Context, vendor string) (QueueStats, error) {
	return readQueueStats(ctx, c.rdb, vendor, queueCounts|queueOldest|queueStalls)
}

// What readQueueStats reads besides the counts (always read).
const (
	queueCounts = 0 // the counts alone
	queueOldest = 1 // the age of the oldest pending call (a second round trip)
	queueStalls = 2 // the stalled calls (in the same round trip)
)

// readQueueStats reads vendor's queues (both lanes): the counts, and the
// figures what asks for.
func readQueueStats(ctx context.Context, rdb redis.UniversalClient, vendor string, what int) (QueueStats, error) {
	key := func(name string) string { return queueKey(vendor, name) }
	hkey := func(name string) string { return highQueueKey(vendor, name) }
	pipe := rdb.Pipeline()
	pending := pipe.LLen(ctx, key("pending"))
	active := pipe.LLen(ctx, key("active"))
	scheduled := pipe.ZCard(ctx, key("scheduled"))
	retry := pipe.ZCard(ctx, key("retry"))
	hpending, hactive, hretry := pipe.LLen(ctx, hkey("pending")), pipe.LLen(ctx, hkey("active")), pipe.ZCard(ctx, hkey("retry"))
	var oldest *redis.StringCmd
	var leases []*redis.ZSliceCmd
	stale := strconv.FormatInt(time.Now().Add(asynqLease-StallAfter).Unix(), 10)
	var stalled []*redis.IntCmd
	if what&queueOldest != 0 {
		oldest = pipe.LIndex(ctx, key("pending"), -1)
	}
	if what&queueStalls != 0 {
		for _, k := range []string{key("lease"), hkey("lease")} {
			leases = append(leases, pipe.ZRangeWithScores(ctx, k, 0, 0))
			stalled = append(stalled, pipe.ZCount(ctx, k, "-inf", "("+stale))
		}
	}
	if _, err := pipe.Exec(ctx); err != nil && err != redis.Nil {
		return QueueStats{}, fmt.Errorf("queue: count %s's queue: %w", vendor, err)
	}
	st := QueueStats{Pending: pending.Val() + hpending.Val(), Active: active.Val() + hactive.Val(), Scheduled: scheduled.Val(),
		Retry: retry.Val() + hretry.Val(), HighPending: hpending.Val()}
	for i := range leases {
		st.Stalled += stalled[i].Val()
		if z := leases[i].Val(); len(z) == 1 {
			renewed := time.Unix(int64(z[0].Score), 0).Add(-asynqLease)
			if d := time.Since(renewed); d > StallAfter {
				st.StalledFor = max(st.StalledFor, d.Truncate(time.Second))
			}
		}
	}
	if oldest != nil && oldest.Val() != "" {
		if ns, err := rdb.HGet(ctx, key("t:"+oldest.Val()), "pending_since").Int64(); err == nil && ns > 0 {
			st.Oldest = max(time.Since(time.Unix(0, ns)), 0)
		}
	}
	return st, nil
}
