package main

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shaper-dev/shaper/config"
	"github.com/shaper-dev/shaper/internal/durations"
	"github.com/shaper-dev/shaper/queue"
	"github.com/shaper-dev/shaper/shaper"
)

func newConfigCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "config", Short: "Work with the config file"}
	cmd.AddCommand(&cobra.Command{
		Use:   "check",
		Short: "Validate the config file and print each vendor's tick",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			path, _ := cmd.Flags().GetString("config")
			cfg, err := config.Load(path)
			if err != nil {
				return err
			}
			printCheck(cmd.OutOrStdout(), cfg)
			return nil
		},
	})
	var user string
	acl := &cobra.Command{
		Use:   "acl",
		Short: "Print the least-privilege Redis ACL for shaper's user",
		Long: `Print the Redis ACL rules that let shaper's worker, enqueue and stats run
and nothing more (asynq's and shaper's keys and channels, no dangerous
commands), as an ACL SETUSER command and as a users.acl line. Replace
PASSWORD, and put the password in redis.password or SHAPER_REDIS_PASSWORD.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			rules := queue.ACLRules(shaper.DefaultKeyPrefix)
			fmt.Fprintf(cmd.OutOrStdout(), "# redis-cli:\nACL SETUSER %s on >PASSWORD %s\n# users.acl:\nuser %s on >PASSWORD %s\n", user, rules, user, rules)
			return nil
		},
	}
	acl.Flags().StringVar(&user, "user", "shaper", "the ACL user's name (redis.username)")
	cmd.AddCommand(acl)
	return cmd
}

func printCheck(w io.Writer, cfg *config.Config) {
	redis := cfg.Redis.Addr
	if cfg.Redis.Embedded() {
		redis = "embedded in-process Redis (not durable; for trying shaper on one machine)"
	}
	fmt.Fprintf(w, "%s: ok, %d vendor(s), redis: %s\n\n", cfg.Path, len(cfg.Vendors), redis)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "VENDOR\tAPPLIES TO\tLIMITS\tBURST\tGUARD\tTICK\tEFFECTIVE RATE\tQUEUE LIMIT\tMAX IN FLIGHT")
	var quotas []string
	measured := false
	defer func() {
		tw.Flush()
		if measured {
			fmt.Fprintf(w, "\nGuard measured: the tick shown holds until a worker has measured how late its calls start and\n"+
				"how much round trips to the vendor vary, then follows them (5ms to a tenth of the window; docs/learning.md).\n"+
				"Set guard to fix it.\n")
		}
		if len(quotas) > 0 {
			fmt.Fprintf(w, "\nQuotas: calls go at the tick until a quota is spent, then wait until calls leave its window.\n")
			for _, q := range quotas {
				fmt.Fprintln(w, "  "+q)
			}
		}
	}()
	printTick := func(tw io.Writer, vendor, appliesTo string, p shaper.Policy, queueLimit string) {
		printTick(tw, vendor, appliesTo, p, queueLimit)
		measured = measured || p.MeasureGuard
		quotas = append(quotas, quotaLines(vendor, appliesTo, p)...)
	}
	for _, v := range cfg.Vendors {
		ql := "unbounded"
		if v.QueueLimit > 0 {
			ql = fmt.Sprint(v.QueueLimit)
		}
		if !v.PerAccount {
			printTick(tw, v.Name, "the vendor", v.Policy(), ql)
			continue
		}
		printTick(tw, v.Name, "each account", v.Policy(), ql)
		for _, o := range v.Overrides {
			printTick(tw, v.Name, "account "+o.Account, v.AccountPolicy(o.Account), "")
		}
		if tp := v.TotalPolicy(); tp != nil {
			printTick(tw, v.Name, "all accounts (total)", *tp, "")
		}
	}
}

// quotaLines says, for each quota of p, how long the pace of the tick
// takes to spend it and what the vendor then gets over the quota's
// window.
func quotaLines(vendor, appliesTo string, p shaper.Policy) []string {
	iv, burst := p.Tick()
	perSecond := shaper.EffectiveRate(iv, burst, time.Second)
	var out []string
	for i, l := range p.Limits {
		if !p.Quota(i) {
			continue
		}
		spent := time.Duration(float64(l.Rate) / perSecond * float64(time.Second)).Round(time.Second)
		out = append(out, fmt.Sprintf("%s (%s): %s: spent in %s at %.4g per second, then %d per %s (%.4g per second on average)",
			vendor, appliesTo, l, durations.Format(spent), perSecond, l.Rate, durations.Format(l.Window), float64(l.Rate)/l.Window.Seconds()))
	}
	return out
}

// printTick prints one row of config check: what a policy applies to and
// its tick. queueLimit is empty on the rows after a vendor's first (a
// vendor has one queue).
func printTick(tw io.Writer, vendor, appliesTo string, p shaper.Policy, queueLimit string) {
	iv, burst := p.Tick()
	limits := ""
	for i, l := range p.Limits {
		if i > 0 {
			limits += " and "
		}
		limits += l.String()
		if p.Quota(i) {
			limits += " (quota)"
		} else if i > 0 && l.Spread {
			limits += " (spread)"
		}
	}
	mif := "no cap"
	if p.MaxInFlight > 0 {
		mif = fmt.Sprint(p.MaxInFlight)
	}
	primary := p.Limits[0].Window
	guard := durations.Format(p.Guard)
	if p.MeasureGuard {
		guard = "measured" // the tick is at the policy's guard until then
	}
	fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%d every %s\t%.4g per %s\t%s\t%s\n", vendor, appliesTo, limits, burst, guard,
		burst, iv, shaper.EffectiveRate(iv, burst, primary), durations.Format(primary), queueLimit, mif)
}
