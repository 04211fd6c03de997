package benche2e

import "errors"

// WritePlot draws res to an SVG file.
func WritePlot(path string, res *Result) error { return errors.New("bench e2e: --plot: not yet") }
