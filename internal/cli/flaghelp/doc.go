// Package flaghelp prints a subcommand's flags for -h: the ones named (a
// command shows those that matter to it, not every flag it accepts), one
// line each: the flag, its value's kind and its explanation.
//
// # Never
//
// It never parses, exits or changes a flag; it writes only to the writer
// it is given.
package flaghelp
