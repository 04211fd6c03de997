package plancmd

import (
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
)

// writeTable prints rep for operators: a header, then one section per
// decode rank with its task table.
func writeTable(w io.Writer, rep *report) error {
	ew := &errWriter{w: w}
	tw := tabwriter.NewWriter(ew, 0, 0, 2, ' ', 0)
	p, d := rep.Prefill, rep.Decode
	fmt.Fprintf(tw, "request\t%s\n", rep.RequestID)
	engine := rep.RemoteEngineID
	if engine == "" {
		engine = "-"
	}
	fmt.Fprintf(tw, "remote\t%s:%d (engine %s, remote pcp %d, dcp %d)\n", rep.RemoteHost, rep.RemotePort, engine, rep.RemotePCP, rep.RemoteDCP)
	fmt.Fprintf(tw, "blocks\t%d local [%s], %d remote [%s]\n", len(rep.LocalBlockIDs), formatBlocks(rep.LocalBlockIDs), len(rep.RemoteBlockIDs), formatBlocks(rep.RemoteBlockIDs))
	fmt.Fprintf(tw, "prefill\ttp %d, pp %d, dp %d, pcp %d, dcp %d\n", p.TP, p.PP, p.DP, p.PCP, p.DCP)
	fmt.Fprintf(tw, "decode\ttp %d, pp %d, dp %d, pcp %d, dcp %d\n", d.TP, d.PP, d.DP, d.PCP, d.DCP)
	heads := ""
	if rep.Model.NumKVHeads > 0 {
		heads = ", " + plural(rep.Model.NumKVHeads, "kv head")
	}
	fmt.Fprintf(tw, "model\t%s, %s%s, decode block_len %s\n", rep.Model.Kind, plural(rep.Model.NumLayers, "layer"), heads, ints(rep.Model.BlockLen))
	fmt.Fprintf(tw, "mode\t%s, tp_num_need_pulls %d, stitch %s\n", rep.Mode, rep.P, yesNo(rep.Stitch))
	fmt.Fprintf(tw, "total\t%s, %s, %s\n", plural(len(rep.Ranks), "decode rank"), plural(rep.Ops, "op"), humanBytes(rep.Bytes))
	tw.Flush()
	if rep.KvflowOnly {
		fmt.Fprintf(ew, "kvflow-only topology: the prefill instance must be kvflow (a seed peer is refused)\n")
	}
	for _, r := range rep.Ranks {
		pp := ""
		if rep.Decode.PP > 1 {
			pp = fmt.Sprintf("pp %d, ", r.PP)
		}
		fmt.Fprintf(ew, "\ndecode rank %d (tp %d, %spcp %d, dcp %d): remote ranks %s, handshake ports %s, %s, %s, %s\n",
			r.Index, r.TP, pp, r.PCP, r.DCP, ints(r.RemoteRanks), ints(r.HandshakePorts), plural(len(r.Tasks), "task"), plural(r.Ops, "op"), humanBytes(r.Bytes))
		tw := tabwriter.NewWriter(ew, 0, 0, 2, ' ', tabwriter.AlignRight)
		slice := ""
		if rep.KvflowOnly {
			slice = "HEAD_SLICE\t"
		}
		fmt.Fprint(tw, "TASK\tREMOTE_RANK\tPORT\tPP\tLAYERS\tHEAD_SLOT\t"+slice+"LOCAL_BLOCKS\tREMOTE_BLOCKS\tOPS\tBYTES\tLAST\tSTITCH\t\n")
		for i, t := range r.Tasks {
			sl := ""
			if rep.KvflowOnly {
				sl = "-\t"
				if t.HeadSplit > 1 {
					sl = fmt.Sprintf("%d/%d\t", t.HeadSlice, t.HeadSplit)
				}
			}
			fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t%d-%d\t%d/%d\t%s%s\t%s\t%d\t%d\t%s\t%s\t\n",
				i, t.RemoteRank, t.HandshakePort, t.PPStage, t.LayerStart, t.LayerEnd-1, t.HeadSlot, t.P, sl,
				formatBlocks(t.LocalBlockIDs), formatBlocks(t.RemoteBlockIDs), t.Ops, t.Bytes, yesNo(t.Last), yesNo(t.Stitch))
		}
		tw.Flush()
	}
	if len(rep.PrefillRanks) > 0 {
		fmt.Fprintf(ew, "\nprefill ranks (reads served per request; the rank frees after EXPECTED_DONES)\n")
		tw := tabwriter.NewWriter(ew, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprint(tw, "PREFILL_RANK\tPORT\tDECODE_READERS\tEXPECTED_DONES\tBYTES\t\n")
		for _, p := range rep.PrefillRanks {
			fmt.Fprintf(tw, "%d\t%d\t%s\t%d\t%d\t\n", p.Rank, p.HandshakePort, ints(p.Readers), p.ExpectedDones, p.Bytes)
		}
		tw.Flush()
	}
	return ew.err
}

func ints(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.Itoa(x)
	}
	return "[" + strings.Join(s, " ") + "]"
}

// plural is "1 noun" or "n nouns".
func plural(n int, noun string) string {
	if n == 1 {
		return "1 " + noun
	}
	return fmt.Sprintf("%d %ss", n, noun)
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

// humanBytes is "N bytes" with a binary-unit gloss from 1 KiB on.
func humanBytes(n uint64) string {
	units := []string{"KiB", "MiB", "GiB", "TiB"}
	if n == 1 {
		return "1 byte"
	}
	if n < 1024 {
		return fmt.Sprintf("%d bytes", n)
	}
	v, u := float64(n)/1024, 0
	for v >= 1024 && u < len(units)-1 {
		v, u = v/1024, u+1
	}
	return fmt.Sprintf("%d bytes (%.1f %s)", n, v, units[u])
}

// errWriter keeps the first write error so that the table code can ignore
// them.
type errWriter struct {
	w   io.Writer
	err error
}

func (e *errWriter) Write(p []byte) (int, error) {
	if e.err != nil {
		return 0, e.err
	}
	n, err := e.w.Write(p)
	e.err = err
	return n, err
}
