package main

import (
	"context"
	"fmt"
	"io"

	"github.com/kvflow/kvflow/internal/sidechannel"
)

// runKeygen writes a CURVE key pair for auth.mode curve.
func runKeygen(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("keygen")
	secret := fs.String("secret", "", "secret key `FILE` to create (mode 0600; never overwritten)")
	public := fs.String("public", "", "public key `FILE` to create")
	if err := parseFlags(fs, args, stdout); err != nil {
		return err
	}
	if *secret == "" || *public == "" {
		return usagef("--secret FILE and --public FILE are required")
	}
	pub, err := sidechannel.WriteKeyPair(*secret, *public)
	if err != nil {
		return err
	}
	fmt.Fprintf(stdout, "wrote %s and %s (public key %s)\n", *secret, *public, pub)
	return nil
}
