package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/sidechannel"
)

func runProbe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("probe")
	remote := fs.String("remote", "", "side channel `HOST:PORT` of a prefill worker (seed or kvflow)")
	done := fs.String("done", "", "also send DONE_RECVING for this `REQUEST_ID` and wait for the ACK")
	asJSON := fs.Bool("json", false, "print JSON")
	timeout := fs.Duration("timeout", 3*time.Second, "overall timeout")
	// The same flags as kvflow serve's auth.* (a decode worker's view).
	var auth probeAuth
	fs.StringVar(&auth.mode, "auth", config.AuthOff, "side channel authentication: off|curve (as the server's auth.mode)")
	fs.StringVar(&auth.serverPublic, "auth-server-public-key-file", "", "with --auth curve: the prefill server's CURVE public key `FILE` (its auth.public_key_file)")
	fs.StringVar(&auth.secret, "auth-secret-key-file", "", "with --auth curve: this client's CURVE secret key `FILE` (kvflow keygen); with --auth-public-key-file, or neither for a one-off pair")
	fs.StringVar(&auth.public, "auth-public-key-file", "", "with --auth curve: this client's CURVE public key `FILE`; a server with auth.authorized_keys_file must list it")
	if err := parseFlags(fs, args, stdout); err != nil {
		return err
	}
	if *remote == "" {
		return usagef("--remote HOST:PORT is required")
	}
	if *timeout < time.Millisecond {
		return usagef("--timeout %v: must be at least 1ms", *timeout)
	}
	host, _, err := net.SplitHostPort(*remote)
	if err != nil {
		return usagef("--remote %q: want HOST:PORT: %v", *remote, err)
	}
	if err := auth.validate(); err != nil {
		return err
	}
	// ZMQ resolves a name in the background and retries forever: an
	// unresolvable host would read as "no reply". Name the DNS failure.
	if net.ParseIP(host) == nil {
		rctx, cancel := context.WithTimeout(ctx, *timeout)
		_, err := net.DefaultResolver.LookupHost(rctx, host)
		cancel()
		if err != nil {
			return fmt.Errorf("resolve %s: %w", host, err)
		}
	}
	curve, err := auth.load()
	if err != nil {
		return err
	}
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{})
	if err != nil {
		return err
	}
	defer zctx.Close()
	opts := sidechannel.DefaultClientOptions()
	opts.Attempts = 1
	opts.AttemptTimeout = *timeout
	opts.Curve = curve
	c, err := sidechannel.NewClient(zctx, opts)
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	t0 := time.Now()
	m, err := c.GetMeta(ctx, *remote)
	if err != nil {
		return fmt.Errorf("get_meta from %s: %w%s", *remote, err, auth.hint(err, *timeout))
	}
	rtt := time.Since(t0)
	out := map[string]any{
		"remote": *remote, "engine_id": m.EngineID, "te_rpc_port": m.TERPCPort,
		"num_blocks": m.NumBlocks, "kv_caches_base_addr": m.KVCachesBaseAddr,
		"boot_epoch": m.Ext.BootEpoch, "get_meta_rtt_us": rtt.Microseconds(),
	}
	var doneRTT time.Duration
	if *done != "" {
		t1 := time.Now()
		if err := c.SendDone(ctx, *remote, *done); err != nil {
			return fmt.Errorf("done_recving %q to %s: %w%s", *done, *remote, err, auth.hint(err, *timeout))
		}
		out["done_request_id"] = *done
		out["ack"] = true
		doneRTT = time.Since(t1)
		out["done_rtt_us"] = doneRTT.Microseconds()
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(out)
	}
	fmt.Fprintf(stdout, "remote       %s\nengine_id    %s\nte_rpc_port  %d\nnum_blocks   %d\ncaches       %d base addresses (first %#x)\nboot_epoch   %d\nget_meta     %v\n",
		*remote, m.EngineID, m.TERPCPort, m.NumBlocks, len(m.KVCachesBaseAddr), first(m.KVCachesBaseAddr), m.Ext.BootEpoch, rtt)
	if *done != "" {
		fmt.Fprintf(stdout, "done         %q acked in %v\n", *done, doneRTT)
	}
	return nil
}

func first(a []uint64) uint64 {
	if len(a) == 0 {
		return 0
	}
	return a[0]
}

// probeAuth is probe's CURVE settings, named and checked as kvflow serve's
// auth.* for a decode worker, except that the client's own key pair is
// optional (without it the client uses a one-off pair, which a server
// without auth.authorized_keys_file admits).
type probeAuth struct {
	mode                         string
	serverPublic, secret, public string
}

func (a probeAuth) validate() error {
	var errs []error
	switch a.mode {
	case config.AuthOff:
		for _, f := range []struct{ flag, val string }{
			{"--auth-server-public-key-file", a.serverPublic},
			{"--auth-secret-key-file", a.secret},
			{"--auth-public-key-file", a.public},
		} {
			if f.val != "" {
				errs = append(errs, fmt.Errorf("%s set without --auth curve", f.flag))
			}
		}
	case config.AuthCurve:
		if a.serverPublic == "" {
			errs = append(errs, errors.New("--auth curve needs --auth-server-public-key-file (the prefill server's public key)"))
		}
		if (a.secret == "") != (a.public == "") {
			errs = append(errs, errors.New("--auth-secret-key-file and --auth-public-key-file go together (this client's key pair; omit both for a one-off pair)"))
		}
	default:
		errs = append(errs, fmt.Errorf("--auth %q: want %s or %s", a.mode, config.AuthOff, config.AuthCurve))
	}
	if len(errs) > 0 {
		return usageError{errors.Join(errs...)}
	}
	return nil
}

// load reads the key files (nil without --auth curve).
func (a probeAuth) load() (*sidechannel.Curve, error) {
	if a.mode != config.AuthCurve {
		return nil, nil
	}
	c, err := sidechannel.LoadCurveKeys(a.secret, a.public, a.serverPublic, "")
	if err != nil {
		return nil, fmt.Errorf("auth keys: %w", err)
	}
	return &c, nil
}

// hint explains a call that got no reply within timeout (the attempt's or
// the overall one, whichever fired first), which is also how a mismatch of
// authentication shows: a CURVE client and server that disagree never
// complete the handshake, so neither side sees an error.
func (a probeAuth) hint(err error, timeout time.Duration) string {
	if !errors.Is(err, sidechannel.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
		return ""
	}
	if a.mode == config.AuthCurve {
		return fmt.Sprintf(" (no reply within %v; with --auth curve a wrong server public key, a server without auth, or a client key the server's authorized keys do not list also look like this)", timeout)
	}
	return fmt.Sprintf(" (no reply within %v; a server with auth.mode curve also looks like this: pass --auth curve --auth-server-public-key-file FILE)", timeout)
}
