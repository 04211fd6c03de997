package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/kvflow/kvflow/internal/sidechannel"
)

func runProbe(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("probe", flag.ContinueOnError)
	fs.SetOutput(stderr)
	remote := fs.String("remote", "", "side channel `HOST:PORT` of a prefill worker (seed or kvflow)")
	done := fs.String("done", "", "also send DONE_RECVING for this `REQUEST_ID` and wait for the ACK")
	asJSON := fs.Bool("json", false, "print JSON")
	timeout := fs.Duration("timeout", 3*time.Second, "overall timeout")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if *remote == "" {
		return usagef("--remote HOST:PORT is required")
	}
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{})
	if err != nil {
		return err
	}
	defer zctx.Close()
	opts := sidechannel.DefaultClientOptions()
	opts.Attempts = 1
	opts.AttemptTimeout = *timeout
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
		return fmt.Errorf("get_meta from %s: %w", *remote, err)
	}
	rtt := time.Since(t0)
	out := map[string]any{
		"remote": *remote, "engine_id": m.EngineID, "te_rpc_port": m.TERPCPort,
		"num_blocks": m.NumBlocks, "kv_caches_base_addr": m.KVCachesBaseAddr,
		"boot_epoch": m.Ext.BootEpoch, "get_meta_rtt_us": rtt.Microseconds(),
	}
	if *done != "" {
		t1 := time.Now()
		if err := c.SendDone(ctx, *remote, *done); err != nil {
			return fmt.Errorf("done_recving %q to %s: %w", *done, *remote, err)
		}
		out["done_request_id"] = *done
		out["ack"] = true
		out["done_rtt_us"] = time.Since(t1).Microseconds()
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(out)
	}
	fmt.Fprintf(stdout, "remote       %s\nengine_id    %s\nte_rpc_port  %d\nnum_blocks   %d\ncaches       %d base addresses (first %#x)\nboot_epoch   %d\nget_meta     %v\n",
		*remote, m.EngineID, m.TERPCPort, m.NumBlocks, len(m.KVCachesBaseAddr), first(m.KVCachesBaseAddr), m.Ext.BootEpoch, rtt)
	if *done != "" {
		fmt.Fprintf(stdout, "done         %q acked in %v\n", *done, out["done_rtt_us"].(int64))
	}
	return nil
}

func first(a []uint64) uint64 {
	if len(a) == 0 {
		return 0
	}
	return a[0]
}
