package main

import (
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/lmittmann/tint"
)

// newLogger makes the process logger: tint on a terminal, JSON otherwise
// (format "auto"), or as asked ("text", "json").
func newLogger(w io.Writer, level, format string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, usagef("log level %q: want debug, info, warn or error", level)
	}
	tty := isTerminal(w)
	switch strings.ToLower(format) {
	case "", "auto":
		if tty {
			format = "text"
		} else {
			format = "json"
		}
	case "text", "json":
	default:
		return nil, usagef("log format %q: want auto, text or json", format)
	}
	if format == "json" {
		return slog.New(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: lv})), nil
	}
	return slog.New(tint.NewTextHandler(w, &tint.Options{Level: lv, TimeFormat: time.TimeOnly, NoColor: !tty})), nil
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
