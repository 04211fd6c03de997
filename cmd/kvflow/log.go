package main

import (
	"context"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/lmittmann/tint"
)

// newLogger makes the process logger: tint on a terminal, JSON otherwise
// (format "auto"), or as asked ("text", "json"). Either way a key appears
// once per line (a logger's With of a key it already carries replaces the
// value: components that each add "role" or "component" would otherwise
// write it twice, which JSON readers resolve inconsistently), and JSON
// durations are strings ("1.5s"), not nanoseconds.
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
		return slog.New(uniqueKeys(slog.NewJSONHandler(w, &slog.HandlerOptions{Level: lv, ReplaceAttr: durationString}))), nil
	}
	return slog.New(uniqueKeys(tint.NewTextHandler(w, &tint.Options{Level: lv, TimeFormat: time.TimeOnly, NoColor: !tty}))), nil
}

// durationString writes a duration as its String ("250ms").
func durationString(_ []string, a slog.Attr) slog.Attr {
	if a.Value.Kind() == slog.KindDuration {
		return slog.String(a.Key, a.Value.Duration().String())
	}
	return a
}

// uniqueKeys wraps h so that a top-level key appears once per record: the
// attrs of With and of the record are merged, a later value of a key
// replacing an earlier one in place. Inside a group (WithGroup) attrs pass
// through unchanged.
func uniqueKeys(h slog.Handler) slog.Handler { return &uniqueHandler{h: h} }

type uniqueHandler struct {
	h     slog.Handler
	attrs []slog.Attr // With's attrs, not yet given to h
}

func (u *uniqueHandler) Enabled(ctx context.Context, l slog.Level) bool { return u.h.Enabled(ctx, l) }

func (u *uniqueHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &uniqueHandler{h: u.h, attrs: mergeAttrs(slices.Clone(u.attrs), as)}
}

func (u *uniqueHandler) WithGroup(name string) slog.Handler {
	if name == "" {
		return u
	}
	return u.h.WithAttrs(u.attrs).WithGroup(name)
}

func (u *uniqueHandler) Handle(ctx context.Context, r slog.Record) error {
	all := slices.Clone(u.attrs)
	var rec []slog.Attr
	r.Attrs(func(a slog.Attr) bool { rec = append(rec, a); return true })
	all = mergeAttrs(all, rec)
	out := slog.NewRecord(r.Time, r.Level, r.Message, r.PC)
	out.AddAttrs(all...)
	return u.h.Handle(ctx, out)
}

// mergeAttrs appends as to dst, a key already in dst taking the new value
// in place.
func mergeAttrs(dst, as []slog.Attr) []slog.Attr {
	for _, a := range as {
		if a.Equal(slog.Attr{}) {
			continue
		}
		if i := slices.IndexFunc(dst, func(d slog.Attr) bool { return d.Key == a.Key && a.Key != "" }); i >= 0 {
			dst[i] = a
			continue
		}
		dst = append(dst, a)
	}
	return dst
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
