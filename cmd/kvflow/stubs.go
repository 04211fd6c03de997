package main

import (
	"context"
	"io"
)

func runPlan(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return usagef("plan: not built yet")
}

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	return usagef("bench: not built yet")
}
